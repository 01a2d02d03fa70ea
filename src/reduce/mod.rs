//! Element-wise reduction kernels for all 12 datatypes.
//!
//! A [`Reducer`] resolves its [`Reduction`] once into function pointers to loops monomorphised
//! per datatype, operator and option (no per-element dispatch), compiled for baseline x86_64 and
//! for AVX2 (picked at run time). Semantics:
//! - integers wrap on overflow (sum, product and the premul multiplication);
//! - f32 / f64 compute natively; float16, bfloat16 and both fp8 formats convert each operand to
//!   f32, compute, and round back to nearest even after *every* operation (the premul product
//!   is rounded before it is combined, so `combine` with a premul equals `prep` then `combine`);
//!   fp8 e4m3 saturates to +-448, the others overflow to infinity;
//! - float Max / Min follow `fmaxf` / `fminf`: a NaN operand loses to a number (the result is NaN
//!   only when both are NaN); the sign of a zero result of max(+0, -0) is unspecified;
//! - `postdiv` (integer average) truncates toward zero, computed exactly for any divisor;
//!   a divisor of 0 or 1 means no division. For float types it divides in the compute type.

pub mod convert;
mod kernel;

use crate::types::{DataType, ReduceKind, Reduction};
use kernel::{Combine, Fn1, Fn2, Map1, Map2, Params, PostDiv, PreMul, Ty};

#[derive(Clone, Copy, Debug)]
pub struct Reducer {
    pub red: Reduction,
    size: usize,
    params: Params,
    prep_fn: Option<Fn1>,
    combine_fn: Fn2,
    finish_fn: Option<Fn1>,
}

/// Whether float16 uses the F16C instructions (when detected; tests also force the portable
/// path so that both are exercised).
fn hw_f16() -> bool {
    #[cfg(test)]
    if tests::force_soft_f16() {
        return false;
    }
    kernel::have_f16c()
}

fn build<T: Ty>(red: &Reduction, wide: bool) -> (Option<Fn1>, Fn2, Option<Fn1>) {
    fn p1<K: Map1>(w: bool) -> Option<Fn1> {
        Some(kernel::pick1::<K>(w))
    }
    fn p2<K: Map2>(w: bool) -> Fn2 {
        kernel::pick2::<K>(w)
    }
    use kernel::{Max, Min, Prod, Sum};
    let pre = red.premul.is_some();
    let prep = if pre { p1::<PreMul<T>>(wide) } else { None };
    let finish = match red.postdiv {
        Some(d) if d > 1 => p1::<PostDiv<T>>(wide),
        _ => None,
    };
    let comb = match (red.kind, pre) {
        (ReduceKind::Sum, false) => p2::<Combine<T, Sum, false>>(wide),
        (ReduceKind::Sum, true) => p2::<Combine<T, Sum, true>>(wide),
        (ReduceKind::Prod, false) => p2::<Combine<T, Prod, false>>(wide),
        (ReduceKind::Prod, true) => p2::<Combine<T, Prod, true>>(wide),
        (ReduceKind::Max, false) => p2::<Combine<T, Max, false>>(wide),
        (ReduceKind::Max, true) => p2::<Combine<T, Max, true>>(wide),
        (ReduceKind::Min, false) => p2::<Combine<T, Min, false>>(wide),
        (ReduceKind::Min, true) => p2::<Combine<T, Min, true>>(wide),
    };
    (prep, comb, finish)
}

impl Reducer {
    pub fn new(red: Reduction) -> Reducer {
        let w = kernel::have_avx2();
        let (prep_fn, combine_fn, finish_fn) = match red.dtype {
            DataType::Int8 => build::<kernel::I8>(&red, w),
            DataType::Uint8 => build::<kernel::U8>(&red, w),
            DataType::Int32 => build::<kernel::I32>(&red, w),
            DataType::Uint32 => build::<kernel::U32>(&red, w),
            DataType::Int64 => build::<kernel::I64>(&red, w),
            DataType::Uint64 => build::<kernel::U64>(&red, w),
            #[cfg(target_arch = "x86_64")]
            DataType::Float16 if w && hw_f16() => build::<kernel::F16Hw>(&red, true),
            DataType::Float16 => build::<kernel::F16>(&red, w),
            DataType::Float32 => build::<kernel::F32>(&red, w),
            DataType::Float64 => build::<kernel::F64>(&red, w),
            DataType::Bfloat16 => build::<kernel::Bf16>(&red, w),
            DataType::Float8e4m3 => build::<kernel::E4m3>(&red, w),
            DataType::Float8e5m2 => build::<kernel::E5m2>(&red, w),
        };
        Reducer {
            red,
            size: red.dtype.size(),
            params: Params {
                premul_bits: red.premul.map_or(0, |s| s.bits),
                postdiv: red.postdiv.unwrap_or(1),
            },
            prep_fn,
            combine_fn,
            finish_fn,
        }
    }

    /// `new`, remembering the last reducer this thread made: small operations ask for the same
    /// one again and again, and picking the kernels costs as much as reducing a few elements.
    /// (Plain reductions have a table: `plain`.)
    pub fn cached(red: Reduction) -> Reducer {
        thread_local! {
            static LAST: std::cell::Cell<Option<Reducer>> = const { std::cell::Cell::new(None) };
        }
        LAST.with(|c| match c.get() {
            Some(r) if r.red == red && !cfg!(test) => r,
            _ => {
                let r = Reducer::new(red);
                c.set(Some(r));
                r
            }
        })
    }

    /// The reducer of `kind` over `dtype` with no scaling, from a table built once (None under
    /// unit tests, which switch kernels between cases).
    pub fn plain(red: &Reduction) -> Option<&'static Reducer> {
        if red.premul.is_some() || red.postdiv.is_some() || cfg!(test) {
            return None;
        }
        const KINDS: [ReduceKind; 4] = [
            ReduceKind::Sum,
            ReduceKind::Prod,
            ReduceKind::Max,
            ReduceKind::Min,
        ];
        static TABLE: once_cell::sync::Lazy<Vec<Reducer>> = once_cell::sync::Lazy::new(|| {
            DataType::ALL
                .iter()
                .flat_map(|&dtype| {
                    KINDS.map(|kind| {
                        Reducer::new(Reduction {
                            dtype,
                            kind,
                            premul: None,
                            postdiv: None,
                        })
                    })
                })
                .collect()
        });
        let r = &TABLE[red.dtype as usize * KINDS.len() + red.kind as usize];
        (r.red == *red).then_some(r)
    }

    /// Whether inputs are scaled before they are combined (PreMulSum, float averages).
    pub fn has_prep(&self) -> bool {
        self.prep_fn.is_some()
    }

    /// `dst[i] = pre(src[i])`: a copy, or the PreMulSum multiplication.
    ///
    /// # Safety
    /// `dst` and `src` are valid for `count` elements; they are equal or do not overlap.
    /// No alignment is required.
    pub unsafe fn prep(&self, dst: *mut u8, src: *const u8, count: usize) {
        match self.prep_fn {
            // SAFETY: the caller's contract is the kernel's.
            Some(f) => unsafe { f(&self.params, dst, src, count) },
            // SAFETY: both valid for count elements of `size` bytes.
            None => unsafe { kernel::copy_bytes(self.size, dst, src, count) },
        }
    }

    /// Whether `prep` is a plain copy (no pre-multiplication, no conversion).
    pub fn prep_is_copy(&self) -> bool {
        self.prep_fn.is_none()
    }

    /// `dst[i] = pre(local[i]) op acc[i]`.
    ///
    /// # Safety
    /// All three valid for `count` elements; `dst` equals one of the inputs or overlaps neither.
    /// No alignment is required.
    pub unsafe fn combine(&self, dst: *mut u8, local: *const u8, acc: *const u8, count: usize) {
        // SAFETY: the caller's contract is the kernel's.
        unsafe { (self.combine_fn)(&self.params, dst, local, acc, count) }
    }

    /// `dst[i] = post(src[i])`: a copy, or the integer average's division.
    ///
    /// # Safety
    /// As `prep`.
    pub unsafe fn finish(&self, dst: *mut u8, src: *const u8, count: usize) {
        match self.finish_fn {
            // SAFETY: the caller's contract is the kernel's.
            Some(f) => unsafe { f(&self.params, dst, src, count) },
            // SAFETY: both valid for count elements of `size` bytes.
            None => unsafe { kernel::copy_bytes(self.size, dst, src, count) },
        }
    }
}

/// Makes element 0 of `count` elements at `ptr` deterministically wrong (the OXCCL_FAULT test
/// switch). Integers get their lowest bit flipped. Floats become `2|x| + 1` (rounded to the
/// type), a change far outside any comparison tolerance; where rounding or saturation gives back
/// the same bits (e.g. e4m3's 448, a NaN) the sign bit is flipped instead. Nothing for `count == 0`.
///
/// # Safety
/// `ptr` is valid for reading and writing `dtype.size()` bytes when `count > 0`; no alignment
/// is required.
pub unsafe fn fault_corrupt(dtype: DataType, ptr: *mut u8, count: usize) {
    if count == 0 {
        return;
    }
    let size = dtype.size();
    let mut b = [0u8; 8];
    // SAFETY: ptr is valid for `size` bytes (caller), b has 8.
    unsafe { std::ptr::copy_nonoverlapping(ptr, b.as_mut_ptr(), size) };
    let old = u64::from_le_bytes(b);
    let bump = |x: f64| 2.0 * x.abs() + 1.0;
    let new = match dtype {
        DataType::Float32 => (bump(f32::from_bits(old as u32) as f64) as f32).to_bits() as u64,
        DataType::Float64 => bump(f64::from_bits(old)).to_bits(),
        DataType::Float16 => {
            convert::f32_to_f16(bump(convert::f16_to_f32(old as u16) as f64) as f32) as u64
        }
        DataType::Bfloat16 => {
            convert::f32_to_bf16(bump(convert::bf16_to_f32(old as u16) as f64) as f32) as u64
        }
        DataType::Float8e4m3 => {
            convert::f32_to_e4m3(bump(convert::e4m3_to_f32(old as u8) as f64) as f32) as u64
        }
        DataType::Float8e5m2 => {
            convert::f32_to_e5m2(bump(convert::e5m2_to_f32(old as u8) as f64) as f32) as u64
        }
        _ => old ^ 1,
    };
    let new = if new == old {
        old ^ (1u64 << (size * 8 - 1))
    } else {
        new
    };
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(new.to_le_bytes().as_ptr(), ptr, size) };
}

/// A float scalar in the bits of `dtype`.
pub fn scalar_from_f64(dtype: crate::types::DataType, v: f64) -> crate::types::Scalar {
    use crate::types::DataType;
    let bits = match dtype {
        DataType::Float64 => v.to_bits(),
        DataType::Float32 => (v as f32).to_bits() as u64,
        DataType::Float16 => convert::f32_to_f16(v as f32) as u64,
        DataType::Bfloat16 => convert::f32_to_bf16(v as f32) as u64,
        DataType::Float8e4m3 => convert::f32_to_e4m3(v as f32) as u64,
        DataType::Float8e5m2 => convert::f32_to_e5m2(v as f32) as u64,
        _ => v as i64 as u64,
    };
    crate::types::Scalar { bits }
}

#[cfg(test)]
mod tests {
    use super::convert::reference::{self as cref, Format};
    use super::*;
    use crate::types::Scalar;
    use std::cell::Cell;
    use std::sync::OnceLock;

    thread_local! {
        static SOFT_F16: Cell<bool> = const { Cell::new(false) };
    }
    pub(super) fn force_soft_f16() -> bool {
        SOFT_F16.with(|s| s.get())
    }
    /// Every datatype, plus float16 again on the portable path (when F16C is present it is the
    /// default); sets the thread's choice as it goes.
    fn variants() -> impl Iterator<Item = DataType> {
        DataType::ALL
            .into_iter()
            .map(|d| (d, false))
            .chain(std::iter::once((DataType::Float16, true)))
            .map(|(d, soft)| {
                SOFT_F16.with(|s| s.set(soft));
                d
            })
    }

    const KINDS: [ReduceKind; 4] = [
        ReduceKind::Sum,
        ReduceKind::Prod,
        ReduceKind::Max,
        ReduceKind::Min,
    ];
    const COUNTS: [usize; 6] = [0, 1, 7, 513, 1023, 1500];
    /// Byte offsets of (dst, local/src, acc) from an 8-aligned base.
    const OFFSETS: [[usize; 3]; 4] = [[0, 0, 0], [1, 1, 1], [0, 3, 0], [5, 0, 2]];

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn unit(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        }
    }

    fn narrow_fmt(dt: DataType) -> Option<Format> {
        match dt {
            DataType::Float16 => Some(Format::F16),
            DataType::Bfloat16 => Some(Format::Bf16),
            DataType::Float8e4m3 => Some(Format::E4m3),
            DataType::Float8e5m2 => Some(Format::E5m2),
            _ => None,
        }
    }

    fn table(f: Format) -> &'static [(f64, u32)] {
        static T: [OnceLock<Vec<(f64, u32)>>; 4] = [
            OnceLock::new(),
            OnceLock::new(),
            OnceLock::new(),
            OnceLock::new(),
        ];
        let i = f as usize;
        T[i].get_or_init(|| cref::finite_table(f))
    }

    fn mask(dt: DataType) -> u64 {
        if dt.size() == 8 {
            u64::MAX
        } else {
            (1u64 << (dt.size() * 8)) - 1
        }
    }

    fn signed(dt: DataType) -> bool {
        matches!(dt, DataType::Int8 | DataType::Int32 | DataType::Int64)
    }

    /// Integer value of the bits, as i128.
    fn ival(dt: DataType, b: u64) -> i128 {
        let bits = dt.size() * 8;
        if signed(dt) {
            ((b << (64 - bits)) as i64 >> (64 - bits)) as i128
        } else {
            b as i128
        }
    }
    fn iwrap(dt: DataType, v: i128) -> u64 {
        (v as u128 as u64) & mask(dt)
    }

    /// Float value of the bits (reference decoding for the narrow formats).
    fn fval(dt: DataType, b: u64) -> f64 {
        match dt {
            DataType::Float32 => f32::from_bits(b as u32) as f64,
            DataType::Float64 => f64::from_bits(b),
            _ => cref::decode(narrow_fmt(dt).unwrap(), b as u32),
        }
    }
    /// Round an exact (or f64-rounded) result of one operation into the type, computing in f32
    /// first for the formats narrower than f32.
    fn fenc(dt: DataType, v: f64) -> u64 {
        match dt {
            DataType::Float64 => v.to_bits(),
            DataType::Float32 => (v as f32).to_bits() as u64,
            _ => {
                let f = narrow_fmt(dt).unwrap();
                if v.is_nan() {
                    // Any NaN pattern of the format: the all-ones one.
                    (1u64 << f.bits()) - 1
                } else {
                    cref::round(f, table(f), v as f32 as f64) as u64
                }
            }
        }
    }

    fn ref_prep(dt: DataType, p: Option<u64>, x: u64) -> u64 {
        let Some(p) = p else { return x };
        if dt.is_float() {
            fenc(dt, fval(dt, x) * fval(dt, p))
        } else {
            iwrap(dt, ival(dt, x).wrapping_mul(ival(dt, p)))
        }
    }

    fn ref_op(dt: DataType, k: ReduceKind, a: u64, b: u64) -> u64 {
        if dt.is_float() {
            let (x, y) = (fval(dt, a), fval(dt, b));
            let r = match k {
                ReduceKind::Sum => x + y,
                ReduceKind::Prod => x * y,
                ReduceKind::Max | ReduceKind::Min if x.is_nan() => y,
                ReduceKind::Max | ReduceKind::Min if y.is_nan() => x,
                ReduceKind::Max => {
                    if x > y {
                        x
                    } else {
                        y
                    }
                }
                ReduceKind::Min => {
                    if x < y {
                        x
                    } else {
                        y
                    }
                }
            };
            fenc(dt, r)
        } else {
            let (x, y) = (ival(dt, a), ival(dt, b));
            iwrap(
                dt,
                match k {
                    ReduceKind::Sum => x + y,
                    ReduceKind::Prod => x.wrapping_mul(y),
                    ReduceKind::Max => x.max(y),
                    ReduceKind::Min => x.min(y),
                },
            )
        }
    }

    fn ref_div(dt: DataType, d: Option<u64>, x: u64) -> u64 {
        match d {
            Some(d) if d > 1 => {
                if dt.is_float() {
                    let dd = if dt == DataType::Float64 {
                        d as f64
                    } else {
                        d as f32 as f64
                    };
                    fenc(dt, fval(dt, x) / dd)
                } else {
                    iwrap(dt, ival(dt, x) / d as i128)
                }
            }
            _ => x,
        }
    }

    fn same(dt: DataType, k: Option<ReduceKind>, got: u64, want: u64) -> bool {
        if !dt.is_float() {
            return got == want;
        }
        let (g, w) = (fval(dt, got), fval(dt, want));
        if g.is_nan() || w.is_nan() {
            return g.is_nan() && w.is_nan();
        }
        let minmax = matches!(k, Some(ReduceKind::Max) | Some(ReduceKind::Min));
        got == want || (minmax && g == 0.0 && w == 0.0)
    }

    /// Test data: random patterns/values, with the type's edge values at fixed positions.
    fn gen(dt: DataType, rng: &mut Rng, n: usize) -> Vec<u64> {
        (0..n)
            .map(|i| {
                let r = rng.next();
                match dt {
                    DataType::Float32 => match i % 16 {
                        3 => f32::NAN.to_bits() as u64,
                        5 => f32::INFINITY.to_bits() as u64,
                        6 => (r as u32 & 0x807f_ffff) as u64, // subnormal
                        7 => f32::MAX.to_bits() as u64,
                        11 => r & 0xffff_ffff,
                        _ => ((rng.unit() * 1000.0) as f32).to_bits() as u64,
                    },
                    DataType::Float64 => match i % 16 {
                        3 => f64::NAN.to_bits(),
                        5 => f64::NEG_INFINITY.to_bits(),
                        7 => f64::MAX.to_bits(),
                        11 => r,
                        _ => (rng.unit() * 1e6).to_bits(),
                    },
                    _ if dt.is_float() => r & mask(dt),
                    _ => match i % 8 {
                        1 => iwrap(
                            dt,
                            if signed(dt) {
                                ival(dt, mask(dt) / 2 + 1)
                            } else {
                                0
                            },
                        ),
                        2 => mask(dt) / 2 + u64::from(!signed(dt)) * (mask(dt) / 2 + 1),
                        3 => mask(dt),
                        _ => r & mask(dt),
                    },
                }
            })
            .collect()
    }

    /// Memory holding elements at a chosen byte offset from an 8-aligned base.
    struct Buf {
        mem: Vec<u64>,
        off: usize,
        size: usize,
    }
    impl Buf {
        fn new(dt: DataType, off: usize, vals: &[u64]) -> Buf {
            let mut b = Buf {
                mem: vec![0xa5a5_a5a5_a5a5_a5a5; (vals.len() * dt.size() + off) / 8 + 2],
                off,
                size: dt.size(),
            };
            b.set(vals);
            b
        }
        fn ptr(&mut self) -> *mut u8 {
            // SAFETY: off < 8 is within the allocation.
            unsafe { (self.mem.as_mut_ptr() as *mut u8).add(self.off) }
        }
        fn set(&mut self, vals: &[u64]) {
            let (s, p) = (self.size, self.ptr());
            for (i, v) in vals.iter().enumerate() {
                // SAFETY: element i lies inside mem.
                unsafe { std::ptr::copy_nonoverlapping(v.to_le_bytes().as_ptr(), p.add(i * s), s) };
            }
        }
        fn get(&mut self, n: usize) -> Vec<u64> {
            let (s, p) = (self.size, self.ptr());
            (0..n)
                .map(|i| {
                    let mut b = [0u8; 8];
                    // SAFETY: element i lies inside mem.
                    unsafe { std::ptr::copy_nonoverlapping(p.add(i * s), b.as_mut_ptr(), s) };
                    u64::from_le_bytes(b)
                })
                .collect()
        }
        /// The guard bytes past the last element are untouched.
        fn guard_ok(&mut self, n: usize) -> bool {
            let start = self.off + n * self.size;
            let bytes: &[u8] =
                // SAFETY: plain reinterpretation of the Vec<u64>'s bytes.
                unsafe { std::slice::from_raw_parts(self.mem.as_ptr() as *const u8, self.mem.len() * 8) };
            bytes[start..].iter().all(|&b| b == 0xa5)
                && bytes[..self.off].iter().all(|&b| b == 0xa5)
        }
    }

    fn premul_scalar(dt: DataType, rng: &mut Rng) -> u64 {
        match dt {
            DataType::Float64 => (1.0f64 / 3.0).to_bits(),
            DataType::Float32 => (1.0f32 / 3.0).to_bits() as u64,
            DataType::Float16 => convert::f32_to_f16(0.37) as u64,
            DataType::Bfloat16 => convert::f32_to_bf16(-0.37) as u64,
            DataType::Float8e4m3 => convert::f32_to_e4m3(1.75) as u64,
            DataType::Float8e5m2 => convert::f32_to_e5m2(0.375) as u64,
            _ => rng.next() & mask(dt),
        }
    }

    fn red(dt: DataType, kind: ReduceKind, premul: Option<u64>, postdiv: Option<u64>) -> Reducer {
        Reducer::new(Reduction {
            dtype: dt,
            kind,
            premul: premul.map(|bits| Scalar { bits }),
            postdiv,
        })
    }

    fn check_vec(ctx: &str, dt: DataType, k: Option<ReduceKind>, got: &[u64], want: &[u64]) {
        assert_eq!(got.len(), want.len());
        for i in 0..got.len() {
            assert!(
                same(dt, k, got[i], want[i]),
                "{ctx}: element {i}: got {:#x} want {:#x}",
                got[i],
                want[i]
            );
        }
    }

    #[test]
    fn combine_every_type_kind_premul_alignment_and_alias() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        for dt in variants() {
            for kind in KINDS {
                for pre in [false, true] {
                    let p = pre.then(|| premul_scalar(dt, &mut rng));
                    let r = red(dt, kind, p, None);
                    for n in COUNTS {
                        let l = gen(dt, &mut rng, n);
                        let a = gen(dt, &mut rng, n);
                        let want: Vec<u64> = (0..n)
                            .map(|i| ref_op(dt, kind, ref_prep(dt, p, l[i]), a[i]))
                            .collect();
                        let same_want: Vec<u64> = (0..n)
                            .map(|i| ref_op(dt, kind, ref_prep(dt, p, l[i]), l[i]))
                            .collect();
                        for [od, ol, oa] in OFFSETS {
                            let ctx = format!(
                                "{} {kind:?} premul={p:?} n={n} off={od},{ol},{oa}",
                                dt.name()
                            );
                            let mut bl = Buf::new(dt, ol, &l);
                            let mut ba = Buf::new(dt, oa, &a);
                            let mut bd = Buf::new(dt, od, &vec![0; n]);
                            // Distinct destination.
                            // SAFETY: all valid for n elements, not overlapping.
                            unsafe { r.combine(bd.ptr(), bl.ptr(), ba.ptr(), n) };
                            check_vec(
                                &format!("{ctx} distinct"),
                                dt,
                                Some(kind),
                                &bd.get(n),
                                &want,
                            );
                            assert!(bd.guard_ok(n), "{ctx}");
                            assert_eq!(bl.get(n), l, "{ctx} local modified");
                            assert_eq!(ba.get(n), a, "{ctx} acc modified");
                            // dst == local.
                            // SAFETY: dst equals local; acc is separate.
                            unsafe { r.combine(bl.ptr(), bl.ptr(), ba.ptr(), n) };
                            check_vec(
                                &format!("{ctx} dst=local"),
                                dt,
                                Some(kind),
                                &bl.get(n),
                                &want,
                            );
                            assert!(bl.guard_ok(n), "{ctx}");
                            // dst == acc.
                            bl.set(&l);
                            // SAFETY: dst equals acc; local is separate.
                            unsafe { r.combine(ba.ptr(), bl.ptr(), ba.ptr(), n) };
                            check_vec(&format!("{ctx} dst=acc"), dt, Some(kind), &ba.get(n), &want);
                            assert!(ba.guard_ok(n), "{ctx}");
                            // dst == local == acc.
                            // SAFETY: all three equal.
                            unsafe { r.combine(bl.ptr(), bl.ptr(), bl.ptr(), n) };
                            check_vec(
                                &format!("{ctx} all same"),
                                dt,
                                Some(kind),
                                &bl.get(n),
                                &same_want,
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn prep_and_finish_every_type() {
        let mut rng = Rng(0x0bad_cafe_f00d_0001);
        for dt in variants() {
            let mut divs = vec![None, Some(0), Some(1), Some(3), Some(7)];
            if !dt.is_float() {
                divs.extend([Some(300), Some(1 << 40), Some(1 << 63), Some(u64::MAX)]);
            }
            for n in COUNTS {
                let x = gen(dt, &mut rng, n);
                for [od, os, _] in OFFSETS {
                    for pre in [false, true] {
                        let p = pre.then(|| premul_scalar(dt, &mut rng));
                        let r = red(dt, ReduceKind::Sum, p, None);
                        let want: Vec<u64> = x.iter().map(|&v| ref_prep(dt, p, v)).collect();
                        let ctx = format!("{} prep premul={p:?} n={n} off={od},{os}", dt.name());
                        let mut bs = Buf::new(dt, os, &x);
                        let mut bd = Buf::new(dt, od, &vec![0; n]);
                        // SAFETY: both valid for n elements, not overlapping.
                        unsafe { r.prep(bd.ptr(), bs.ptr(), n) };
                        check_vec(&ctx, dt, None, &bd.get(n), &want);
                        assert!(bd.guard_ok(n), "{ctx}");
                        // SAFETY: in place.
                        unsafe { r.prep(bs.ptr(), bs.ptr(), n) };
                        check_vec(&format!("{ctx} in place"), dt, None, &bs.get(n), &want);
                    }
                    for &d in &divs {
                        let r = red(dt, ReduceKind::Sum, None, d);
                        let want: Vec<u64> = x.iter().map(|&v| ref_div(dt, d, v)).collect();
                        let ctx = format!("{} finish postdiv={d:?} n={n} off={od},{os}", dt.name());
                        let mut bs = Buf::new(dt, os, &x);
                        let mut bd = Buf::new(dt, od, &vec![0; n]);
                        // SAFETY: both valid for n elements, not overlapping.
                        unsafe { r.finish(bd.ptr(), bs.ptr(), n) };
                        check_vec(&ctx, dt, None, &bd.get(n), &want);
                        assert!(bd.guard_ok(n), "{ctx}");
                        // SAFETY: in place.
                        unsafe { r.finish(bs.ptr(), bs.ptr(), n) };
                        check_vec(&format!("{ctx} in place"), dt, None, &bs.get(n), &want);
                    }
                }
            }
        }
    }

    /// A three-rank reduction as the executor runs it: prep, combine twice, finish, with every
    /// combination of premul and postdiv.
    #[test]
    fn pipeline_with_premul_and_postdiv() {
        let mut rng = Rng(0x5eed_5eed_5eed_5eed);
        for dt in variants() {
            for kind in KINDS {
                for pre in [false, true] {
                    for d in [None, Some(3)] {
                        let p = pre.then(|| premul_scalar(dt, &mut rng));
                        let r = red(dt, kind, p, d);
                        let n = 1023;
                        let xs: Vec<Vec<u64>> = (0..3).map(|_| gen(dt, &mut rng, n)).collect();
                        let want: Vec<u64> = (0..n)
                            .map(|i| {
                                let mut acc = ref_prep(dt, p, xs[0][i]);
                                for x in &xs[1..] {
                                    acc = ref_op(dt, kind, ref_prep(dt, p, x[i]), acc);
                                }
                                ref_div(dt, d, acc)
                            })
                            .collect();
                        let mut b: Vec<Buf> = xs.iter().map(|x| Buf::new(dt, 1, x)).collect();
                        let mut acc = Buf::new(dt, 0, &vec![0; n]);
                        // SAFETY: distinct buffers of n elements; in-place steps alias exactly.
                        unsafe {
                            r.prep(acc.ptr(), b[0].ptr(), n);
                            r.combine(acc.ptr(), b[1].ptr(), acc.ptr(), n);
                            r.combine(b[2].ptr(), b[2].ptr(), acc.ptr(), n);
                            r.finish(acc.ptr(), b[2].ptr(), n);
                        }
                        let ctx = format!("{} {kind:?} premul={p:?} postdiv={d:?}", dt.name());
                        check_vec(&ctx, dt, Some(kind), &acc.get(n), &want);
                    }
                }
            }
        }
    }

    #[test]
    fn zero_count_touches_nothing() {
        for dt in variants() {
            let r = red(dt, ReduceKind::Sum, Some(1), Some(3));
            // SAFETY: count 0: the pointers are never dereferenced.
            unsafe {
                r.prep(std::ptr::null_mut(), std::ptr::null(), 0);
                r.combine(std::ptr::null_mut(), std::ptr::null(), std::ptr::null(), 0);
                r.finish(std::ptr::null_mut(), std::ptr::null(), 0);
                fault_corrupt(dt, std::ptr::null_mut(), 0);
            }
        }
    }

    #[test]
    fn fault_corrupt_changes_element_zero_only() {
        let mut rng = Rng(77);
        for dt in variants() {
            let mut vals = gen(dt, &mut rng, 64);
            vals[0] = 0;
            if dt.is_float() {
                vals[1] = fenc(dt, 448.0); // saturates e4m3
            }
            for start in 0..vals.len() - 3 {
                let v = &vals[start..start + 3];
                let mut b = Buf::new(dt, 1, v);
                // SAFETY: 3 elements at an unaligned address.
                unsafe { fault_corrupt(dt, b.ptr(), 3) };
                let got = b.get(3);
                assert_eq!(&got[1..], &v[1..], "{}", dt.name());
                assert!(b.guard_ok(3));
                if dt.is_float() {
                    let (g, w) = (fval(dt, got[0]), fval(dt, v[0]));
                    if !w.is_nan() {
                        assert!(
                            g.is_nan() || g != w,
                            "{} {:#x} -> {:#x}",
                            dt.name(),
                            v[0],
                            got[0]
                        );
                        if w.is_finite() && g.is_finite() && w.abs() < 100.0 {
                            assert!((g - w).abs() >= 0.5, "{} {w} -> {g}", dt.name());
                        }
                    }
                } else {
                    assert_eq!(got[0], v[0] ^ 1, "{}", dt.name());
                }
            }
        }
    }

    fn gbps(bytes: usize, f: &mut dyn FnMut()) -> f64 {
        f();
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = std::time::Instant::now();
            f();
            best = best.min(t.elapsed().as_secs_f64());
        }
        bytes as f64 / best / 1e9
    }

    /// `cargo test --release --lib reduce::tests::bandwidth -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn bandwidth() {
        let bytes = 64 << 20;
        let n = bytes / 4;
        let local = vec![1.5f32; n];
        let mut acc = vec![2.5f32; n];
        let mut dst = vec![0f32; n];
        let memcpy = gbps(bytes, &mut || {
            // SAFETY: distinct vectors of `bytes` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    local.as_ptr() as *const u8,
                    dst.as_mut_ptr() as *mut u8,
                    bytes,
                )
            };
            std::hint::black_box(&mut dst);
        });
        println!("memcpy 64 MiB: {memcpy:.2} GB/s");
        for dt in [
            DataType::Float32,
            DataType::Float16,
            DataType::Bfloat16,
            DataType::Float8e4m3,
            DataType::Int32,
        ] {
            let r = red(dt, ReduceKind::Sum, None, None);
            let cnt = bytes / dt.size();
            let (l, a, d) = (
                local.as_ptr() as *const u8,
                acc.as_mut_ptr() as *mut u8,
                dst.as_mut_ptr() as *mut u8,
            );
            // SAFETY: three distinct buffers of `bytes` bytes, aligned.
            let sum = gbps(bytes, &mut || unsafe { r.combine(d, l, a, cnt) });
            // SAFETY: as above, in place on acc.
            let inplace = gbps(bytes, &mut || unsafe { r.combine(a, l, a, cnt) });
            // SAFETY: as above, shifted by one byte (unaligned path), one element fewer.
            let unal = gbps(bytes, &mut || unsafe {
                r.combine(d.add(1), l.add(1), a.add(1), cnt - 1)
            });
            println!(
                "{} sum 64 MiB: {sum:.2} GB/s ({:.2}x memcpy), in place {inplace:.2}, unaligned {unal:.2}",
                dt.name(),
                sum / memcpy
            );
        }
    }
}
