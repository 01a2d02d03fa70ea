//! Bit-exact conversions between `f32` and the narrow float formats NCCL reduces over:
//! IEEE binary16 (`f16`), bfloat16, OCP fp8 e4m3 (bias 7, no infinities, `S.1111.111` is NaN,
//! largest finite 448) and OCP fp8 e5m2 (bias 15, IEEE-like with infinities and NaNs).
//!
//! Widening (`*_to_f32`) is exact, and keeps NaN payloads so that every pattern round-trips.
//! Narrowing (`f32_to_*`) rounds to nearest, ties to even; f16, bf16 and e5m2 overflow to
//! infinity, e4m3 saturates to +-448 (NVIDIA's "satfinite" conversion, infinities included);
//! a NaN stays a NaN (its top payload bits are kept, the quiet bit set if they were all zero).
//!
//! All functions are branch-free selects over integer/float operations so that loops calling
//! them vectorise.

/// Describes a narrow float format: `E` exponent bits, `M` mantissa bits, exponent bias `B`.
/// `INF`: the format has infinities (all-ones exponent is special); otherwise only the
/// all-ones pattern is NaN and the rest of the top binade holds finite numbers.
struct Fmt<const E: u32, const M: u32, const B: i32, const INF: bool>;

impl<const E: u32, const M: u32, const B: i32, const INF: bool> Fmt<E, M, B, INF> {
    const BITS: u32 = 1 + E + M;
    const MAG_MASK: u32 = (1 << (E + M)) - 1;
    const EXP_MASK: u32 = ((1 << E) - 1) << M;
    const MANT_MASK: u32 = (1 << M) - 1;
    /// Shift between an f32 mantissa and this format's mantissa.
    const SH: u32 = 23 - M;
    /// The f32 exponent field difference between f32 and this format.
    const REBIAS: u32 = ((127 - B) as u32) << 23;

    /// Exact widening of the low `BITS` bits of `x`.
    #[inline(always)]
    fn to_f32(x: u32) -> f32 {
        let sign = (x >> (Self::BITS - 1)) << 31;
        let mag = x & Self::MAG_MASK;
        let exp = mag & Self::EXP_MASK;
        let mant = mag & Self::MANT_MASK;
        // Normal numbers: move the fields into place and rebias the exponent.
        let normal = (mag << Self::SH) + Self::REBIAS;
        // Subnormals (and zero): mant * 2^(1-B-M), exact in f32.
        let sub_scale = f32::from_bits(((127 + 1 - B - M as i32) as u32) << 23);
        let sub = ((mant as i32) as f32 * sub_scale).to_bits();
        let special = if INF {
            // Inf/NaN: all-ones exponent keeps its mantissa (NaN payload).
            0x7f80_0000 | (mant << Self::SH)
        } else {
            0x7fc0_0000
        };
        let is_special = if INF {
            exp == Self::EXP_MASK
        } else {
            mag == Self::MAG_MASK
        };
        let r = if is_special {
            special
        } else if exp == 0 {
            sub
        } else {
            normal
        };
        f32::from_bits(r | sign)
    }

    /// Round-to-nearest-even narrowing; the result is in the low `BITS` bits.
    #[inline(always)]
    fn from_f32(f: f32) -> u32 {
        let bits = f.to_bits();
        let sign = (bits >> 31) << (Self::BITS - 1);
        let a = bits & 0x7fff_ffff;
        // NaN: keep the top payload bits; make sure the mantissa stays non-zero.
        let nan = if INF {
            let m = (a >> Self::SH) & Self::MANT_MASK;
            let m = if m == 0 { 1 << (M - 1) } else { m };
            Self::EXP_MASK | m
        } else {
            Self::MAG_MASK
        };
        // Largest pattern an overflow turns into: infinity, or the largest finite number.
        let top = if INF {
            Self::EXP_MASK
        } else {
            Self::MAG_MASK - 1
        };
        // Normal range: rebias, then round the dropped SH bits to nearest even.
        let reb = a.wrapping_sub(Self::REBIAS);
        let odd = (reb >> Self::SH) & 1;
        let rounded = reb.wrapping_add((1 << (Self::SH - 1)) - 1 + odd) >> Self::SH;
        let normal = if rounded > top { top } else { rounded };
        // Subnormal range: adding 2^(1-B-M+23) makes the float unit align the last place with
        // the format's subnormal step, so the FPU performs the rounding (ties to even).
        let magic = f32::from_bits(((127 + 1 - B - M as i32 + 23) as u32) << 23);
        let sub = (f32::from_bits(a) + magic).to_bits() - magic.to_bits();
        // Smallest normal of the format, as f32 bits.
        let min_normal = ((127 + 1 - B) as u32) << 23;
        let r = if a > 0x7f80_0000 {
            nan
        } else if a < min_normal {
            sub
        } else {
            normal
        };
        r | sign
    }
}

type F16Fmt = Fmt<5, 10, 15, true>;
type E4M3Fmt = Fmt<4, 3, 7, false>;
type E5M2Fmt = Fmt<5, 2, 15, true>;

/// IEEE binary16 bits to f32 (exact).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    F16Fmt::to_f32(h as u32)
}

/// f32 to IEEE binary16 bits, round to nearest even, overflow to infinity.
#[inline(always)]
pub fn f32_to_f16(f: f32) -> u16 {
    F16Fmt::from_f32(f) as u16
}

/// bfloat16 bits to f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f32 to bfloat16 bits, round to nearest even, overflow to infinity.
#[inline(always)]
pub fn f32_to_bf16(f: f32) -> u16 {
    let b = f.to_bits();
    let nan = {
        let h = b >> 16;
        if h & 0x7f == 0 {
            h | 0x40
        } else {
            h
        }
    };
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let r = if b & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    };
    r as u16
}

/// fp8 e4m3 bits to f32 (exact).
#[inline(always)]
pub fn e4m3_to_f32(x: u8) -> f32 {
    E4M3Fmt::to_f32(x as u32)
}

/// f32 to fp8 e4m3 bits, round to nearest even, saturating to +-448 (infinities too).
#[inline(always)]
pub fn f32_to_e4m3(f: f32) -> u8 {
    E4M3Fmt::from_f32(f) as u8
}

/// fp8 e5m2 bits to f32 (exact).
#[inline(always)]
pub fn e5m2_to_f32(x: u8) -> f32 {
    E5M2Fmt::to_f32(x as u32)
}

/// f32 to fp8 e5m2 bits, round to nearest even, overflow to infinity.
#[inline(always)]
pub fn f32_to_e5m2(f: f32) -> u8 {
    E5M2Fmt::from_f32(f) as u8
}

#[cfg(test)]
pub(crate) mod reference {
    //! Independent, slow reference arithmetic for the narrow formats: decoding by the textbook
    //! formula in f64, and rounding by searching the sorted table of representable values.

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Format {
        F16,
        Bf16,
        E4m3,
        E5m2,
    }

    impl Format {
        pub fn params(self) -> (u32, u32, i32, bool) {
            // (exponent bits, mantissa bits, bias, has infinities)
            match self {
                Format::F16 => (5, 10, 15, true),
                Format::Bf16 => (8, 7, 127, true),
                Format::E4m3 => (4, 3, 7, false),
                Format::E5m2 => (5, 2, 15, true),
            }
        }
        pub fn bits(self) -> u32 {
            let (e, m, _, _) = self.params();
            1 + e + m
        }
    }

    /// Textbook decoding into f64 (NaN for every NaN pattern).
    pub fn decode(fmt: Format, x: u32) -> f64 {
        let (e, m, b, inf) = fmt.params();
        let nb = 1 + e + m;
        let neg = (x >> (nb - 1)) & 1 == 1;
        let ef = (x >> m) & ((1 << e) - 1);
        let mf = x & ((1 << m) - 1);
        let emax_field = (1u32 << e) - 1;
        let mag = if inf && ef == emax_field {
            if mf == 0 {
                f64::INFINITY
            } else {
                f64::NAN
            }
        } else if !inf && ef == emax_field && mf == (1 << m) - 1 {
            f64::NAN
        } else if ef == 0 {
            mf as f64 * 2f64.powi(1 - b - m as i32)
        } else {
            (1.0 + mf as f64 / 2f64.powi(m as i32)) * 2f64.powi(ef as i32 - b)
        };
        if neg {
            -mag
        } else {
            mag
        }
    }

    /// Non-negative finite patterns, in increasing order of value.
    pub fn finite_table(fmt: Format) -> Vec<(f64, u32)> {
        let nb = fmt.bits();
        let mut v: Vec<(f64, u32)> = (0..(1u32 << (nb - 1)))
            .map(|p| (decode(fmt, p), p))
            .filter(|(x, _)| x.is_finite())
            .collect();
        v.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
        v
    }

    /// Round-to-nearest-even of `x` (any f64) into `fmt`, with `table = finite_table(fmt)`.
    pub fn round(fmt: Format, table: &[(f64, u32)], x: f64) -> u32 {
        let (e, m, _, inf) = fmt.params();
        let nb = fmt.bits();
        let sign = if x.is_sign_negative() {
            1u32 << (nb - 1)
        } else {
            0
        };
        if x.is_nan() {
            return u32::MAX; // caller checks "is a NaN pattern"
        }
        let a = x.abs();
        let inf_pat = ((1u32 << e) - 1) << m;
        let (max_v, max_p) = *table.last().unwrap();
        if a > max_v {
            if !inf {
                return sign | max_p; // satfinite
            }
            // One step past the largest finite value is the next power of two (= infinity).
            let next = 2f64.powi(max_v.log2().floor() as i32 + 1);
            let r = if a - max_v < next - a {
                max_p
            } else {
                inf_pat // the tie goes to the even pattern, infinity
            };
            return sign | r;
        }
        let i = table.partition_point(|&(v, _)| v <= a) - 1;
        let (lo, lp) = table[i];
        if lo == a {
            return sign | lp;
        }
        let (hi, hp) = table[i + 1];
        let r = if a - lo < hi - a {
            lp
        } else if a - lo > hi - a {
            hp
        } else if lp & 1 == 0 {
            lp
        } else {
            hp
        };
        sign | r
    }

    pub fn is_nan_pattern(fmt: Format, p: u32) -> bool {
        decode(fmt, p).is_nan()
    }
}

#[cfg(test)]
mod tests {
    use super::reference::{decode, finite_table, is_nan_pattern, round, Format};
    use super::*;

    fn widen(fmt: Format, p: u32) -> f32 {
        match fmt {
            Format::F16 => f16_to_f32(p as u16),
            Format::Bf16 => bf16_to_f32(p as u16),
            Format::E4m3 => e4m3_to_f32(p as u8),
            Format::E5m2 => e5m2_to_f32(p as u8),
        }
    }
    fn narrow(fmt: Format, f: f32) -> u32 {
        match fmt {
            Format::F16 => f32_to_f16(f) as u32,
            Format::Bf16 => f32_to_bf16(f) as u32,
            Format::E4m3 => f32_to_e4m3(f) as u32,
            Format::E5m2 => f32_to_e5m2(f) as u32,
        }
    }
    const ALL: [Format; 4] = [Format::F16, Format::Bf16, Format::E4m3, Format::E5m2];

    #[test]
    fn every_pattern_round_trips_and_widens_exactly() {
        for fmt in ALL {
            for p in 0..(1u32 << fmt.bits()) {
                let w = widen(fmt, p);
                let d = decode(fmt, p);
                if d.is_nan() {
                    assert!(w.is_nan(), "{fmt:?} {p:#x}");
                } else {
                    assert_eq!(w as f64, d, "{fmt:?} {p:#x}");
                    assert_eq!(w.is_sign_negative(), d.is_sign_negative(), "{fmt:?} {p:#x}");
                }
                assert_eq!(narrow(fmt, w), p, "{fmt:?} {p:#x} via {:#x}", w.to_bits());
            }
        }
    }

    fn check(fmt: Format, table: &[(f64, u32)], f: f32) {
        let got = narrow(fmt, f);
        if f.is_nan() {
            assert!(
                is_nan_pattern(fmt, got),
                "{fmt:?} NaN {:#x} -> {got:#x}",
                f.to_bits()
            );
        } else {
            let want = round(fmt, table, f as f64);
            assert_eq!(got, want, "{fmt:?} {f:e} ({:#x})", f.to_bits());
        }
    }

    #[test]
    fn narrowing_matches_reference_at_ties_and_random_values() {
        for fmt in ALL {
            let table = finite_table(fmt);
            // Every midpoint between neighbours (exact in f32) and the floats either side of it.
            for w in table.windows(2) {
                let mid = ((w[0].0 + w[1].0) / 2.0) as f32;
                assert_eq!(mid as f64, (w[0].0 + w[1].0) / 2.0);
                for v in [
                    mid,
                    f32::from_bits(mid.to_bits() - 1),
                    f32::from_bits(mid.to_bits() + 1),
                ] {
                    check(fmt, &table, v);
                    check(fmt, &table, -v);
                }
                check(fmt, &table, w[0].0 as f32);
            }
            // Around and past the largest finite value.
            let max = table.last().unwrap().0;
            let ulp = max - table[table.len() - 2].0;
            for k in [0.25, 0.5, 0.75, 1.0, 1.5, 3.0, 1e6] {
                let v = (max + ulp * k) as f32;
                for v in [
                    v,
                    f32::from_bits(v.to_bits() - 1),
                    f32::from_bits(v.to_bits() + 1),
                ] {
                    check(fmt, &table, v);
                    check(fmt, &table, -v);
                }
            }
            for v in [
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::MAX,
                f32::MIN_POSITIVE,
                1e-45,
                0.0,
                -0.0,
            ] {
                check(fmt, &table, v);
            }
            for nan in [
                0x7fc0_0000u32,
                0x7f80_0001,
                0xffc0_0000,
                0x7fbf_ffff,
                0xff80_0001,
            ] {
                check(fmt, &table, f32::from_bits(nan));
            }
            // Random f32 bit patterns, and random values in the format's range.
            let mut s = 0x9e37_79b9_7f4a_7c15u64;
            for _ in 0..200_000 {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                check(fmt, &table, f32::from_bits(s as u32));
                let r = ((s >> 32) as u32 as f64 / u32::MAX as f64) * 2.0 - 1.0;
                check(fmt, &table, (r * max * 1.1) as f32);
                check(fmt, &table, (r * table[8].0) as f32);
            }
        }
    }

    #[test]
    fn e4m3_saturates_and_e5m2_overflows() {
        assert_eq!(f32_to_e4m3(1e9), 0x7e);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xfe);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert_eq!(f32_to_e5m2(1e9), 0x7c);
        assert_eq!(e5m2_to_f32(0x7b), 57344.0);
        assert_eq!(f32_to_f16(65520.0), 0x7c00);
        assert_eq!(f32_to_f16(65519.996), 0x7bff);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    }
}
