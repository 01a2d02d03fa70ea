//! The CUDA kernels' reduction arithmetic (`cuda/reduce.cuh`) against the host executor's
//! (`nccl::reduce::Reducer`, `nccl::reduce::convert`), bit for bit, without a GPU: the header is
//! plain C++ under g++, driven by `tests/cuda_arith/driver.cpp` over edge values and seeded
//! random patterns of every datatype, for every operator, with and without a premul scalar and
//! an integer-average divisor, and the narrow formats' conversions on their own.
//!
//! Where the host leaves a result unspecified, any result of the right class passes (and the
//! count of such differences is printed): two NaN operands (which NaN comes out depends on the
//! operand order LLVM picks, and the F16C float16 path quiets signalling NaNs the software
//! conversion keeps: max / min of two float16 NaNs is the only case that differs on an x86_64
//! with F16C), and max / min of +0 and -0 (the sign). Everything else, NaN results included,
//! must be equal.
//!
//! `OXCCL_CUDA_ARITH_DUMP=dir` also writes the driver's input and output there (`input.bin`,
//! `output.bin`), for running the same records through the header on a GPU.

use nccl::reduce::{convert, Reducer};
use nccl::types::{DataType, ReduceKind, Reduction, Scalar};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const KINDS: [ReduceKind; 4] = [
    ReduceKind::Sum,
    ReduceKind::Prod,
    ReduceKind::Max,
    ReduceKind::Min,
];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn mask(dt: DataType) -> u64 {
    if dt.size() == 8 {
        u64::MAX
    } else {
        (1u64 << (dt.size() * 8)) - 1
    }
}

fn is_nan(dt: DataType, x: u64) -> bool {
    match dt {
        DataType::Float16 => x & 0x7fff > 0x7c00,
        DataType::Bfloat16 => x & 0x7fff > 0x7f80,
        DataType::Float8e4m3 => x & 0x7f == 0x7f,
        DataType::Float8e5m2 => x & 0x7f > 0x7c,
        DataType::Float32 => x & 0x7fff_ffff > 0x7f80_0000,
        DataType::Float64 => x & !(1 << 63) > 0x7ff0 << 48,
        _ => false,
    }
}

fn is_zero(dt: DataType, x: u64) -> bool {
    x & (mask(dt) >> 1) == 0
}

/// The type's bits of an f32 value (narrow formats through the library's conversion).
fn from_f32(dt: DataType, v: f32) -> u64 {
    match dt {
        DataType::Float16 => convert::f32_to_f16(v) as u64,
        DataType::Bfloat16 => convert::f32_to_bf16(v) as u64,
        DataType::Float8e4m3 => convert::f32_to_e4m3(v) as u64,
        DataType::Float8e5m2 => convert::f32_to_e5m2(v) as u64,
        DataType::Float32 => v.to_bits() as u64,
        DataType::Float64 => (v as f64).to_bits(),
        _ => v as i64 as u64 & mask(dt),
    }
}

/// Values worth pairing with each other: zeros, ones, extremes, NaNs of several payloads and
/// signs, infinities, subnormals, overflow and saturation boundaries.
fn edges(dt: DataType) -> Vec<u64> {
    let m = mask(dt);
    let v: Vec<u64> = match dt {
        DataType::Float32 => vec![
            0,
            0x8000_0000,
            1.0f32.to_bits() as u64,
            (-1.0f32).to_bits() as u64,
            0.5f32.to_bits() as u64,
            3.0f32.to_bits() as u64,
            (1.0f32 / 3.0).to_bits() as u64,
            (-0.1f32).to_bits() as u64,
            0x7f80_0000, // +inf
            0xff80_0000, // -inf
            0x7fc0_0000, // quiet NaNs
            0xffc0_0000,
            0x7fff_ffff,
            0xffc1_2345,
            0x7f80_0001, // signalling NaNs
            0xff80_0001,
            0x7fa0_0000,
            0x0000_0001, // subnormals
            0x8000_0001,
            0x007f_ffff,
            0x8040_0000,
            0x0080_0000, // smallest normal
            0x7f7f_ffff, // largest finite
            0xff7f_ffff,
            0x7f00_0000, // 2^127
            0x3400_0000, // 2^-23
            0x1f80_0000, // 2^-64
            0x1f80_0001,
            0x6000_0000,
        ],
        DataType::Float64 => vec![
            0,
            1 << 63,
            1.0f64.to_bits(),
            (-1.0f64).to_bits(),
            3.0f64.to_bits(),
            (1.0f64 / 3.0).to_bits(),
            (-0.1f64).to_bits(),
            0x7ff0 << 48,
            0xfff0 << 48,
            0x7ff8 << 48,
            0xfff8 << 48,
            0x7fff_ffff_ffff_ffff,
            0xfff8_0000_1234_5678,
            0x7ff0_0000_0000_0001,
            0xfff4_0000_0000_0000,
            1,
            0x8000_0000_0000_0001,
            0x000f_ffff_ffff_ffff,
            0x0010_0000_0000_0000,
            0x7fef_ffff_ffff_ffff,
            0xffef_ffff_ffff_ffff,
            0x7fe0_0000_0000_0000,
            0x3cb0_0000_0000_0000, // 2^-52
            0x2000_0000_0000_0000,
            0x2000_0000_0000_0001,
            0x5ff0_0000_0000_0000,
        ],
        DataType::Float16 => vec![
            0, 0x8000, 0x3c00, 0xbc00, 0x3800, 0x4200, 0x3555, 0x3c01, 0x7c00, 0xfc00, 0x7e00,
            0xfe00, 0x7fff, 0xfe55, 0x7c01, 0xfc01, 0x7d00, 0x0001, 0x8001, 0x03ff, 0x0200, 0x0400,
            0x8400, 0x7bff, 0xfbff, 0x7bfe, 0x7800, 0x1400, 0x0c00, 0x5bff, 0x5c00,
        ],
        DataType::Bfloat16 => vec![
            0, 0x8000, 0x3f80, 0xbf80, 0x3f00, 0x4040, 0x3eab, 0x3f81, 0x7f80, 0xff80, 0x7fc0,
            0xffc0, 0x7fff, 0xffd5, 0x7f81, 0xff81, 0x7fa0, 0x0001, 0x8001, 0x007f, 0x0040, 0x0080,
            0x8080, 0x7f7f, 0xff7f, 0x7f7e, 0x7f00, 0x3c00, 0x1f80, 0x5f80, 0x2000,
        ],
        DataType::Float8e4m3 => vec![
            0, 0x80, 0x38, 0xb8, 0x30, 0x40, 0x7e, 0xfe, 0x7d, 0x7f, 0xff, 0x01, 0x81, 0x07, 0x08,
            0x77, 0x78, 0x3a, 0x0c, 0x2f,
        ],
        DataType::Float8e5m2 => vec![
            0, 0x80, 0x3c, 0xbc, 0x38, 0x40, 0x7b, 0xfb, 0x7c, 0xfc, 0x7d, 0x7e, 0xfd, 0xff, 0x01,
            0x81, 0x03, 0x04, 0x78, 0x3d,
        ],
        _ => {
            let bits = dt.size() as u32 * 8;
            let half = 1u64 << (bits - 1);
            vec![
                0,
                1,
                2,
                3,
                5,
                7,
                0x55 & m,
                m,
                m - 1,
                m - 2,
                half,
                half - 1,
                half + 1,
                half - 2,
                half >> 1,
                (half >> 1) + 1,
                m / 3,
                m / 3 + 1,
                (1u64 << (bits / 2)) & m,
                ((1u64 << (bits / 2)) + 1) & m,
            ]
        }
    };
    v.into_iter().map(|x| x & m).collect()
}

/// Random patterns: raw bits, and for floats also values of moderate size (so sums and products
/// round instead of one operand swamping the other).
fn random(dt: DataType, rng: &mut Rng) -> u64 {
    let r = rng.next();
    if r & 3 != 0 {
        return (r >> 8) & mask(dt);
    }
    match dt {
        DataType::Float32 => (r >> 32 & 0x807f_ffff) | ((r >> 2 & 15) + 120) << 23,
        DataType::Float64 => (r >> 8 & 0x800f_ffff_ffff_ffff) | ((r >> 2 & 15) + 1016) << 52,
        DataType::Float16 => (r >> 32 & 0x83ff) | ((r >> 2 & 7) + 12) << 10,
        DataType::Bfloat16 => (r >> 32 & 0x807f) | ((r >> 2 & 15) + 120) << 7,
        _ => (r >> 8) & mask(dt),
    }
}

/// Operand pairs for one datatype, and how many of them come first as every pair of edge
/// values; then for the 8-bit types every pair of patterns, for the 16-bit floats every pattern
/// once on each side (with random partners), for the wider types random pairs.
fn pairs(dt: DataType, rng: &mut Rng) -> (Vec<u64>, Vec<u64>, usize) {
    let e = edges(dt);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for &x in &e {
        for &y in &e {
            a.push(x);
            b.push(y);
        }
    }
    let ne = a.len();
    if dt.size() == 1 {
        for x in 0..256 {
            for y in 0..256 {
                a.push(x);
                b.push(y);
            }
        }
    } else {
        if dt.size() == 2 {
            for x in 0..=0xffffu64 {
                a.push(x);
                b.push(random(dt, rng));
                a.push(random(dt, rng));
                b.push(x);
            }
        }
        for _ in 0..600 {
            a.push(random(dt, rng));
            b.push(random(dt, rng));
        }
        for _ in 0..200 {
            let x = e[(rng.next() % e.len() as u64) as usize];
            a.push(x);
            b.push(random(dt, rng));
            a.push(random(dt, rng));
            b.push(x);
        }
    }
    (a, b, ne)
}

fn premuls(dt: DataType, rng: &mut Rng) -> Vec<u64> {
    let m = mask(dt);
    match dt {
        DataType::Float32 | DataType::Float64 => {
            let f = |v: f64| {
                if dt == DataType::Float64 {
                    v.to_bits()
                } else {
                    (v as f32).to_bits() as u64
                }
            };
            let nan = if dt == DataType::Float64 {
                0xfff4_0000_0000_0001
            } else {
                0xff80_0001
            };
            let qnan = if dt == DataType::Float64 {
                0x7ff8 << 48
            } else {
                0x7fc0_0000
            };
            vec![
                f(1.0 / 3.0),
                f(-0.37),
                f(2.0),
                f(f64::INFINITY),
                f(-0.0),
                qnan,
                nan,
                1,
                random(dt, rng),
            ]
        }
        DataType::Float16 | DataType::Bfloat16 | DataType::Float8e4m3 | DataType::Float8e5m2 => {
            vec![
                from_f32(dt, 0.37),
                from_f32(dt, -1.75),
                from_f32(dt, 2.0),
                from_f32(dt, f32::INFINITY), // 448 for e4m3
                from_f32(dt, -0.0),
                from_f32(dt, f32::NAN),
                m >> 1, // the positive all-ones NaN
                1,      // smallest subnormal
                random(dt, rng),
            ]
        }
        _ => vec![m, 3, m >> 1, (m >> 1) + 1, 0, rng.next() & m],
    }
}

fn postdivs(dt: DataType, extra: bool) -> Vec<Option<u64>> {
    let mut v = vec![None, Some(3)];
    if extra {
        v.extend([Some(0), Some(1), Some(7)]);
        if dt.is_float() {
            v.extend([Some(1 << 40), Some((1 << 24) + 1), Some(u64::MAX)]);
        } else {
            v.extend([
                Some(300),
                Some(1 << 31),
                Some((1 << 32) - 1),
                Some(1 << 32),
                Some(1 << 40),
                Some(1 << 63),
                Some((1 << 63) - 1),
                Some((1 << 63) + 1),
                Some(u64::MAX),
            ]);
        }
    }
    v
}

fn to_bytes(dt: DataType, vals: &[u64]) -> Vec<u8> {
    let s = dt.size();
    vals.iter()
        .flat_map(|v| v.to_le_bytes().into_iter().take(s))
        .collect()
}

fn from_bytes(dt: DataType, b: &[u8]) -> Vec<u64> {
    let s = dt.size();
    b.chunks_exact(s)
        .map(|c| {
            let mut w = [0u8; 8];
            w[..s].copy_from_slice(c);
            u64::from_le_bytes(w)
        })
        .collect()
}

/// One arithmetic record: its reduction, operands and the host's answers.
struct Case {
    red: Reduction,
    a: Vec<u64>,
    b: Vec<u64>,
    /// finish(combine(a, b)), prep(a), finish(a).
    want: [Vec<u64>; 3],
}

fn host(red: Reduction, a: &[u64], b: &[u64]) -> [Vec<u64>; 3] {
    let dt = red.dtype;
    let r = Reducer::new(red);
    let n = a.len();
    let (ab, bb) = (to_bytes(dt, a), to_bytes(dt, b));
    let mut c = vec![0u8; ab.len()];
    let mut p = vec![0u8; ab.len()];
    let mut f = vec![0u8; ab.len()];
    // SAFETY: every buffer holds n elements; the in-place finish passes the same pointer twice.
    unsafe {
        r.combine(c.as_mut_ptr(), ab.as_ptr(), bb.as_ptr(), n);
        r.finish(c.as_mut_ptr(), c.as_ptr(), n);
        r.prep(p.as_mut_ptr(), ab.as_ptr(), n);
        r.finish(f.as_mut_ptr(), ab.as_ptr(), n);
    }
    [from_bytes(dt, &c), from_bytes(dt, &p), from_bytes(dt, &f)]
}

/// Pairs past the edge values' in records other than the plain ones (no premul or postdiv).
const SHARE: usize = 2048;

fn cases() -> Vec<Case> {
    let mut rng = Rng(0x0c0d_a0a1_7e57_5eed);
    let mut out = Vec::new();
    for dt in DataType::ALL {
        let (a, b, ne) = pairs(dt, &mut rng);
        let pre = premuls(dt, &mut rng);
        for kind in KINDS {
            let scalars = std::iter::once(None).chain(pre.iter().map(|&p| Some(p)));
            for (si, premul) in scalars.enumerate() {
                for postdiv in postdivs(dt, kind == ReduceKind::Sum && si == 0) {
                    let red = Reduction {
                        dtype: dt,
                        kind,
                        premul: premul.map(|bits| Scalar { bits }),
                        postdiv,
                    };
                    // Plain records take every pair; the others a share of the pairs past the
                    // edge values' (a different share each).
                    let (a, b) = if si == 0 && postdiv.is_none() {
                        (a.clone(), b.clone())
                    } else {
                        let k = (a.len() - ne).div_ceil(SHARE);
                        let off = ne + (rng.next() % k as u64) as usize;
                        let pick = |v: &[u64]| {
                            let rest = v[off..].iter().step_by(k);
                            v[..ne].iter().chain(rest).copied().collect()
                        };
                        (pick(&a), pick(&b))
                    };
                    let want = host(red, &a, &b);
                    out.push(Case { red, a, b, want });
                }
            }
        }
    }
    out
}

const NARROW: [DataType; 4] = [
    DataType::Float16,
    DataType::Bfloat16,
    DataType::Float8e4m3,
    DataType::Float8e5m2,
];

/// f32 patterns for the narrowing check: every top half (sign, exponent, 7 mantissa bits) with
/// low halves around the formats' rounding points.
fn f32_patterns(rng: &mut Rng) -> Vec<u32> {
    let lows = [
        0u32, 1, 0x0fff, 0x1000, 0x1001, 0x2000, 0x3000, 0x7fff, 0x8000, 0x8001, 0xf000, 0xffff,
    ];
    let mut v = Vec::new();
    for hi in 0..=0xffffu32 {
        for &lo in &lows {
            v.push(hi << 16 | lo);
        }
        v.push(hi << 16 | (rng.next() as u32 & 0xffff));
    }
    v
}

fn narrow_host(dt: DataType, f: u32) -> u64 {
    let f = f32::from_bits(f);
    match dt {
        DataType::Float16 => convert::f32_to_f16(f) as u64,
        DataType::Bfloat16 => convert::f32_to_bf16(f) as u64,
        DataType::Float8e4m3 => convert::f32_to_e4m3(f) as u64,
        _ => convert::f32_to_e5m2(f) as u64,
    }
}

fn widen_host(dt: DataType, x: u64) -> u64 {
    let f = match dt {
        DataType::Float16 => convert::f16_to_f32(x as u16),
        DataType::Bfloat16 => convert::bf16_to_f32(x as u16),
        DataType::Float8e4m3 => convert::e4m3_to_f32(x as u8),
        _ => convert::e5m2_to_f32(x as u8),
    };
    f.to_bits() as u64
}

fn header(input: &mut Vec<u8>, dt: DataType, kind: u32, premul: Option<u64>, mode: u32) {
    input.extend((dt as u32).to_le_bytes());
    input.extend(kind.to_le_bytes());
    input.extend(u32::from(premul.is_some()).to_le_bytes());
    input.extend(mode.to_le_bytes());
    input.extend(premul.unwrap_or(0).to_le_bytes());
}

/// Compiles the driver; None (after saying why) when there is no g++.
fn build_driver() -> Option<PathBuf> {
    build("driver")
}

/// Compiles `tests/cuda_arith/<name>.cpp` with the headers of `cuda/`; None (after saying why)
/// when there is no g++.
fn build(name: &str) -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if Command::new("g++").arg("--version").output().is_err() {
        eprintln!("SKIPPED: no g++ on PATH, cuda/reduce.cuh was not checked");
        return None;
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-arith");
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join(name);
    let out = Command::new("g++")
        .args(["-std=c++17", "-O2", "-ffp-contract=off"])
        .args(["-Wall", "-Wextra", "-Wshadow", "-Werror"])
        .arg("-I")
        .arg(root.join("cuda"))
        .arg(root.join(format!("tests/cuda_arith/{name}.cpp")))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run g++");
    assert!(
        out.status.success(),
        "g++ failed on tests/cuda_arith/{name}.cpp:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(exe)
}

fn run_driver(exe: &Path, input: Vec<u8>) -> Vec<u8> {
    let mut child = Command::new(exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the driver");
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let mut out = Vec::new();
    child.stdout.take().unwrap().read_to_end(&mut out).unwrap();
    writer.join().unwrap().expect("write to the driver");
    assert!(child.wait().unwrap().success(), "the driver failed");
    out
}

#[test]
fn header_matches_host_reducer_bit_for_bit() {
    let t0 = std::time::Instant::now();
    let Some(exe) = build_driver() else { return };
    let cases = cases();
    let mut rng = Rng(0x5eed_0f32_0f32);
    let f32s = f32_patterns(&mut rng);

    let mut input = Vec::new();
    for c in &cases {
        let kind = c.red.kind as u32;
        header(
            &mut input,
            c.red.dtype,
            kind,
            c.red.premul.map(|s| s.bits),
            0,
        );
        input.extend(c.red.postdiv.unwrap_or(0).to_le_bytes());
        input.extend((c.a.len() as u64).to_le_bytes());
        input.extend(to_bytes(c.red.dtype, &c.a));
        input.extend(to_bytes(c.red.dtype, &c.b));
    }
    for dt in NARROW {
        header(&mut input, dt, 0, None, 1);
        input.extend(0u64.to_le_bytes());
        input.extend((f32s.len() as u64).to_le_bytes());
        input.extend(f32s.iter().flat_map(|f| f.to_le_bytes()));
        let all = 1u64 << (dt.size() * 8);
        header(&mut input, dt, 0, None, 2);
        input.extend(0u64.to_le_bytes());
        input.extend(all.to_le_bytes());
        input.extend(to_bytes(dt, &(0..all).collect::<Vec<_>>()));
    }
    let dump = std::env::var_os("OXCCL_CUDA_ARITH_DUMP").map(PathBuf::from);
    if let Some(d) = &dump {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("input.bin"), &input).unwrap();
    }
    let out = run_driver(&exe, input);
    if let Some(d) = &dump {
        std::fs::write(d.join("output.bin"), &out).unwrap();
    }

    let mut pos = 0;
    let mut take = |dt: DataType, n: usize| {
        let bytes = n * dt.size();
        assert!(pos + bytes <= out.len(), "the driver's output is short");
        let v = from_bytes(dt, &out[pos..pos + bytes]);
        pos += bytes;
        v
    };
    let mut bad: Vec<String> = Vec::new();
    let (mut checked, mut relaxed) = (0usize, 0usize);
    for c in &cases {
        let dt = c.red.dtype;
        let n = c.a.len();
        let got = [take(dt, n), take(dt, n), take(dt, n)];
        let premul_nan = c.red.premul.is_some_and(|s| is_nan(dt, s.bits & mask(dt)));
        for (i, (&a, &b)) in c.a.iter().zip(&c.b).enumerate() {
            let pa = c.want[1][i];
            for (w, what) in ["finish(combine)", "prep", "finish"].iter().enumerate() {
                let (g, x) = (got[w][i], c.want[w][i]);
                checked += 1;
                if g == x {
                    continue;
                }
                // Unspecified on the host: which of two NaNs, the sign of max/min(+0, -0).
                let ok = match w {
                    0 if is_nan(dt, pa) && is_nan(dt, b) => is_nan(dt, g) && is_nan(dt, x),
                    // The premul product of two NaNs is either (then combined on).
                    0 if premul_nan && is_nan(dt, a) => is_nan(dt, g) && is_nan(dt, x),
                    0 if matches!(c.red.kind, ReduceKind::Max | ReduceKind::Min)
                        && dt.is_float()
                        && is_zero(dt, pa)
                        && is_zero(dt, b) =>
                    {
                        is_zero(dt, g) && is_zero(dt, x)
                    }
                    1 if premul_nan && is_nan(dt, a) => is_nan(dt, g) && is_nan(dt, x),
                    _ => false,
                };
                if ok {
                    relaxed += 1;
                } else if bad.len() < 40 {
                    bad.push(format!(
                        "{} {:?} premul={:x?} postdiv={:?} {what}: a={a:#x} b={b:#x} \
                         (prep(a)={pa:#x}): header {g:#x}, host {x:#x}",
                        dt.name(),
                        c.red.kind,
                        c.red.premul.map(|s| s.bits),
                        c.red.postdiv,
                    ));
                } else {
                    bad.push(String::new());
                }
            }
        }
    }
    for dt in NARROW {
        let got = take(dt, f32s.len());
        for (i, &f) in f32s.iter().enumerate() {
            checked += 1;
            let want = narrow_host(dt, f);
            if got[i] != want && bad.len() < 40 {
                bad.push(format!(
                    "{} narrowing {f:#010x}: header {:#x}, host {want:#x}",
                    dt.name(),
                    got[i]
                ));
            } else if got[i] != want {
                bad.push(String::new());
            }
        }
        let all = 1usize << (dt.size() * 8);
        let got = take(DataType::Uint32, all);
        for (x, &g) in got.iter().enumerate() {
            checked += 1;
            let want = widen_host(dt, x as u64);
            if g != want && bad.len() < 40 {
                bad.push(format!(
                    "{} widening {x:#x}: header {g:#010x}, host {want:#010x}",
                    dt.name()
                ));
            } else if g != want {
                bad.push(String::new());
            }
        }
    }
    assert_eq!(pos, out.len(), "the driver wrote more than expected");
    eprintln!(
        "{} records, {checked} results compared, {relaxed} differences where the host leaves \
         the result unspecified, {:.1} s",
        cases.len() + 2 * NARROW.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        bad.is_empty(),
        "{} results differ from the host's:\n{}",
        bad.len(),
        bad.iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The direct all-reduce's element loop (`cuda/direct.cuh`, the loop of the `oxccl_direct*`
/// kernels) run on the host thread by thread (`tests/cuda_arith/direct.cpp`), against the host
/// executor's reductions applied rank by rank: acc = prep_0(x_0), then acc = op(prep_k(x_k), acc)
/// for k = 1..n with each rank's own premultiplier, then finish (the integer average's
/// divisor). Every datatype and operator, 2 to 16 ranks (both kernels' loops), counts that leave
/// tails after the 16-byte packs, grids of 1 to 64 threads, the last rank's buffers aligned or
/// not, in and out of place; the bytes around every output, and the inputs out of place, must
/// be untouched. Values are finite and never -0, so that every result is specified.
#[test]
fn direct_all_reduce_loop_matches_the_host_rank_by_rank() {
    let Some(exe) = build("direct") else { return };
    let mut rng = Rng(0xd1ec_7a11_0000_0001);
    let ranks = [2usize, 3, 4, 5, 9, 16];
    let counts = [1usize, 5, 16, 33, 1000, 4099];
    let threads = [1u32, 3, 64];
    let mut input = Vec::new();
    let mut records = Vec::new(); // (dtype, n, count, inputs' expected output, what)
    let mut i = 0usize;
    for dt in DataType::ALL {
        let value = |rng: &mut Rng| match dt {
            DataType::Float16
            | DataType::Bfloat16
            | DataType::Float8e4m3
            | DataType::Float8e5m2
            | DataType::Float32
            | DataType::Float64 => {
                let v = (rng.next() % 17) as f32 * 0.25 - 2.0;
                from_f32(dt, if v == 0.0 { 0.0 } else { v })
            }
            _ => rng.next() & mask(dt),
        };
        let float = matches!(
            dt,
            DataType::Float16
                | DataType::Bfloat16
                | DataType::Float8e4m3
                | DataType::Float8e5m2
                | DataType::Float32
                | DataType::Float64
        );
        for kind in KINDS {
            // (premultiply per rank, divisor): plain; for sums also PreMulSum and (integers)
            // the average's divisor.
            let mut variants = vec![(false, None)];
            if kind == ReduceKind::Sum {
                variants.push((true, None));
                if !float {
                    variants.push((false, Some(0)));
                }
            }
            for (premul, postdiv) in variants {
                for _ in 0..3 {
                    let n = ranks[i % ranks.len()];
                    let count = counts[(i / ranks.len()) % counts.len()];
                    let nt = threads[i % threads.len()];
                    let (mis, in_place) = (((i / 2) % 2) as u32, i % 2 == 1);
                    i += 1;
                    let postdiv = postdiv.map(|_| n as u64);
                    let scalars: Vec<Option<u64>> = (0..n)
                        .map(|_| {
                            premul.then(|| {
                                if float {
                                    let c = [0.5f32, -1.5, 3.0, 0.25];
                                    from_f32(dt, c[(rng.next() % 4) as usize])
                                } else {
                                    rng.next() & mask(dt)
                                }
                            })
                        })
                        .collect();
                    let xs: Vec<Vec<u64>> = (0..n)
                        .map(|_| (0..count).map(|_| value(&mut rng)).collect())
                        .collect();
                    // The host's rank-by-rank reduction.
                    let reducer = |k: usize| {
                        Reducer::new(Reduction {
                            dtype: dt,
                            kind,
                            premul: scalars[k].map(|bits| Scalar { bits }),
                            postdiv,
                        })
                    };
                    let bytes: Vec<Vec<u8>> = xs.iter().map(|x| to_bytes(dt, x)).collect();
                    let mut acc = vec![0u8; bytes[0].len()];
                    let mut next = acc.clone();
                    // SAFETY: every buffer holds `count` elements of `dt`; no two alias.
                    unsafe {
                        reducer(0).prep(acc.as_mut_ptr(), bytes[0].as_ptr(), count);
                        for (k, x) in bytes.iter().enumerate().skip(1) {
                            reducer(k).combine(next.as_mut_ptr(), x.as_ptr(), acc.as_ptr(), count);
                            std::mem::swap(&mut acc, &mut next);
                        }
                        reducer(0).finish(next.as_mut_ptr(), acc.as_ptr(), count);
                    }
                    let want = from_bytes(dt, &next);
                    for v in [dt as u32, kind as u32, n as u32, nt] {
                        input.extend(v.to_le_bytes());
                    }
                    input.extend((count as u64).to_le_bytes());
                    input.extend(mis.to_le_bytes());
                    input.extend(u32::from(in_place).to_le_bytes());
                    input.extend(postdiv.unwrap_or(0).to_le_bytes());
                    for s in &scalars {
                        input.extend(u64::from(s.is_some()).to_le_bytes());
                        input.extend(s.unwrap_or(0).to_le_bytes());
                    }
                    for b in &bytes {
                        input.extend_from_slice(b);
                    }
                    let what = format!(
                        "{} {kind:?} premul {premul} postdiv {postdiv:?}, {n} ranks, {count} \
                         elements, {nt} threads, misaligned {mis}, in place {in_place}",
                        dt.name()
                    );
                    records.push((dt, n, count, want, what));
                }
            }
        }
    }
    let out = run_driver(&exe, input);
    let mut pos = 0;
    let mut checked = 0usize;
    for (dt, n, count, want, what) in &records {
        for k in 0..*n {
            let b = count * dt.size();
            let got = from_bytes(*dt, &out[pos..pos + b]);
            pos += b;
            if let Some(e) = (0..*count).find(|&e| got[e] != want[e]) {
                panic!(
                    "{what}: rank {k}'s element {e} is {:#x}, the host says {:#x}",
                    got[e], want[e]
                );
            }
            checked += count;
        }
        assert_eq!(
            out[pos..pos + 4],
            1u32.to_le_bytes(),
            "{what}: bytes around an output, or an input, changed"
        );
        pos += 4;
    }
    assert_eq!(pos, out.len(), "the driver wrote more than expected");
    eprintln!("{} records, {checked} elements compared", records.len());
}
