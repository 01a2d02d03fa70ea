//! Monomorphised element-wise loops. One instantiation per (datatype, operation, options), each
//! compiled twice on x86_64 (baseline SSE2, and AVX2+F16C) and picked once by `Reducer::new`.
//!
//! The loops run over slices when every pointer is aligned for the element type (the fast path
//! LLVM vectorises), handling the allowed aliasing (`dst` equal to an input) with in-place
//! slices; otherwise they stage chunks through aligned stack buffers with byte copies.

use super::convert;

/// A datatype: its storage `S`, the type arithmetic happens in `C`, and the conversions.
pub(crate) trait Ty: 'static {
    type S: Copy + Default + 'static;
    type C: Copy;
    /// Loop-invariant form of the integer divisor.
    type D: Copy;
    fn load(s: Self::S) -> Self::C;
    fn store(c: Self::C) -> Self::S;
    fn add(a: Self::C, b: Self::C) -> Self::C;
    fn mul(a: Self::C, b: Self::C) -> Self::C;
    fn max(a: Self::C, b: Self::C) -> Self::C;
    fn min(a: Self::C, b: Self::C) -> Self::C;
    /// The scalar whose little-endian bits (this type's size) are `bits`.
    fn scalar(bits: u64) -> Self::C;
    fn divisor(d: u64) -> Self::D;
    fn div(s: Self::S, d: Self::D) -> Self::S;
    /// Whether loops go 8 elements at a time through `load8` / `store8` (types whose
    /// conversions are hardware vector instructions); else LLVM vectorises `load` / `store`.
    const WIDE8: bool = false;
    #[inline(always)]
    fn load8(s: [Self::S; 8]) -> [Self::C; 8] {
        s.map(Self::load)
    }
    #[inline(always)]
    fn store8(c: [Self::C; 8]) -> [Self::S; 8] {
        c.map(Self::store)
    }
}

macro_rules! int_ty {
    ($name:ident, $t:ty, $d:ty, |$x:ident, $dv:ident| $div:expr, |$draw:ident| $mk:expr) => {
        pub(crate) struct $name;
        impl Ty for $name {
            type S = $t;
            type C = $t;
            type D = $d;
            #[inline(always)]
            fn load(s: $t) -> $t {
                s
            }
            #[inline(always)]
            fn store(c: $t) -> $t {
                c
            }
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn mul(a: $t, b: $t) -> $t {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t {
                Ord::max(a, b)
            }
            #[inline(always)]
            fn min(a: $t, b: $t) -> $t {
                Ord::min(a, b)
            }
            #[inline(always)]
            fn scalar(bits: u64) -> $t {
                bits as $t
            }
            #[inline(always)]
            fn divisor($draw: u64) -> $d {
                $mk
            }
            #[inline(always)]
            fn div($x: $t, $dv: $d) -> $t {
                $div
            }
        }
    };
}

// Up to 32 bits, f64 division truncated is exact (the quotient's rounding error is far below
// its distance to the next integer) and vectorises, unlike integer division.
int_ty!(I8, i8, f64, |x, d| (x as f64 / d) as i8, |d| d as f64);
int_ty!(U8, u8, f64, |x, d| (x as f64 / d) as u8, |d| d as f64);
int_ty!(I32, i32, f64, |x, d| (x as f64 / d) as i32, |d| d as f64);
int_ty!(U32, u32, f64, |x, d| (x as f64 / d) as u32, |d| d as f64);
int_ty!(U64, u64, u64, |x, d| x / d, |d| d);
// A divisor past i64::MAX still has to divide i64::MIN correctly (to -1 at 2^63).
int_ty!(
    I64,
    i64,
    u64,
    |x, d| if d <= i64::MAX as u64 {
        x / d as i64
    } else {
        (x as i128 / d as i128) as i64
    },
    |d| d
);

macro_rules! float_ty {
    ($name:ident, $t:ty, $bits:ty) => {
        pub(crate) struct $name;
        impl Ty for $name {
            type S = $t;
            type C = $t;
            type D = $t;
            #[inline(always)]
            fn load(s: $t) -> $t {
                s
            }
            #[inline(always)]
            fn store(c: $t) -> $t {
                c
            }
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t {
                a + b
            }
            #[inline(always)]
            fn mul(a: $t, b: $t) -> $t {
                a * b
            }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t {
                a.max(b)
            }
            #[inline(always)]
            fn min(a: $t, b: $t) -> $t {
                a.min(b)
            }
            #[inline(always)]
            fn scalar(bits: u64) -> $t {
                <$t>::from_bits(bits as $bits)
            }
            #[inline(always)]
            fn divisor(d: u64) -> $t {
                d as $t
            }
            #[inline(always)]
            fn div(x: $t, d: $t) -> $t {
                x / d
            }
        }
    };
}

float_ty!(F32, f32, u32);
float_ty!(F64, f64, u64);

macro_rules! narrow_ty {
    ($name:ident, $s:ty, $to:path, $from:path) => {
        pub(crate) struct $name;
        impl Ty for $name {
            type S = $s;
            type C = f32;
            type D = f32;
            #[inline(always)]
            fn load(s: $s) -> f32 {
                $to(s)
            }
            #[inline(always)]
            fn store(c: f32) -> $s {
                $from(c)
            }
            #[inline(always)]
            fn add(a: f32, b: f32) -> f32 {
                a + b
            }
            #[inline(always)]
            fn mul(a: f32, b: f32) -> f32 {
                a * b
            }
            #[inline(always)]
            fn max(a: f32, b: f32) -> f32 {
                a.max(b)
            }
            #[inline(always)]
            fn min(a: f32, b: f32) -> f32 {
                a.min(b)
            }
            #[inline(always)]
            fn scalar(bits: u64) -> f32 {
                $to(bits as $s)
            }
            #[inline(always)]
            fn divisor(d: u64) -> f32 {
                d as f32
            }
            #[inline(always)]
            fn div(x: $s, d: f32) -> $s {
                $from($to(x) / d)
            }
        }
    };
}

narrow_ty!(F16, u16, convert::f16_to_f32, convert::f32_to_f16);
narrow_ty!(Bf16, u16, convert::bf16_to_f32, convert::f32_to_bf16);
narrow_ty!(E4m3, u8, convert::e4m3_to_f32, convert::f32_to_e4m3);
narrow_ty!(E5m2, u8, convert::e5m2_to_f32, convert::f32_to_e5m2);

/// float16 through the F16C conversion instructions, 8 at a time (the tails use the software
/// conversions, which agree bit for bit except that the hardware quiets signalling NaNs).
/// Only selected by `Reducer::new` after detecting AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
pub(crate) struct F16Hw;

#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU supports F16C and AVX.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(super) unsafe fn widen8(s: [u16; 8]) -> [f32; 8] {
        // SAFETY: plain bit reinterpretations between same-sized vector/array types.
        unsafe { std::mem::transmute(_mm256_cvtph_ps(std::mem::transmute::<[u16; 8], __m128i>(s))) }
    }

    /// # Safety
    /// As `widen8`.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(super) unsafe fn narrow8(c: [f32; 8]) -> [u16; 8] {
        // SAFETY: as above; the rounding immediate selects round-to-nearest-even.
        unsafe {
            let v = std::mem::transmute::<[f32; 8], __m256>(c);
            std::mem::transmute(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Ty for F16Hw {
    type S = u16;
    type C = f32;
    type D = f32;
    const WIDE8: bool = true;
    #[inline(always)]
    fn load(s: u16) -> f32 {
        F16::load(s)
    }
    #[inline(always)]
    fn store(c: f32) -> u16 {
        F16::store(c)
    }
    #[inline(always)]
    fn load8(s: [u16; 8]) -> [f32; 8] {
        // SAFETY: F16Hw is only instantiated after detecting AVX2 and F16C.
        unsafe { f16c::widen8(s) }
    }
    #[inline(always)]
    fn store8(c: [f32; 8]) -> [u16; 8] {
        // SAFETY: as above.
        unsafe { f16c::narrow8(c) }
    }
    #[inline(always)]
    fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    fn mul(a: f32, b: f32) -> f32 {
        a * b
    }
    #[inline(always)]
    fn max(a: f32, b: f32) -> f32 {
        a.max(b)
    }
    #[inline(always)]
    fn min(a: f32, b: f32) -> f32 {
        a.min(b)
    }
    #[inline(always)]
    fn scalar(bits: u64) -> f32 {
        F16::scalar(bits)
    }
    #[inline(always)]
    fn divisor(d: u64) -> f32 {
        d as f32
    }
    #[inline(always)]
    fn div(x: u16, d: f32) -> u16 {
        F16::div(x, d)
    }
}

/// Whether the F16C float16 kernels may run here.
#[inline]
pub(crate) fn have_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A reduction operator.
pub(crate) trait Op: 'static {
    fn apply<T: Ty>(a: T::C, b: T::C) -> T::C;
}
pub(crate) struct Sum;
pub(crate) struct Prod;
pub(crate) struct Max;
pub(crate) struct Min;
impl Op for Sum {
    #[inline(always)]
    fn apply<T: Ty>(a: T::C, b: T::C) -> T::C {
        T::add(a, b)
    }
}
impl Op for Prod {
    #[inline(always)]
    fn apply<T: Ty>(a: T::C, b: T::C) -> T::C {
        T::mul(a, b)
    }
}
impl Op for Max {
    #[inline(always)]
    fn apply<T: Ty>(a: T::C, b: T::C) -> T::C {
        T::max(a, b)
    }
}
impl Op for Min {
    #[inline(always)]
    fn apply<T: Ty>(a: T::C, b: T::C) -> T::C {
        T::min(a, b)
    }
}

/// What every kernel receives: the raw premul scalar bits and the divisor.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Params {
    pub premul_bits: u64,
    pub postdiv: u64,
}

/// Per-call, decoded form of `Params`.
pub(crate) struct Ctx<T: Ty> {
    p: T::C,
    d: T::D,
}

/// An element-wise unary map.
pub(crate) trait Map1: 'static {
    type T: Ty;
    fn f(x: <Self::T as Ty>::S, c: &Ctx<Self::T>) -> <Self::T as Ty>::S;
    fn f8(x: [<Self::T as Ty>::S; 8], c: &Ctx<Self::T>) -> [<Self::T as Ty>::S; 8];
}
/// An element-wise binary map (`x` = local, `y` = accumulator).
pub(crate) trait Map2: 'static {
    type T: Ty;
    fn f(x: <Self::T as Ty>::S, y: <Self::T as Ty>::S, c: &Ctx<Self::T>) -> <Self::T as Ty>::S;
    fn f8(
        x: [<Self::T as Ty>::S; 8],
        y: [<Self::T as Ty>::S; 8],
        c: &Ctx<Self::T>,
    ) -> [<Self::T as Ty>::S; 8];
}

/// `x * premul`, rounded back to the storage type.
pub(crate) struct PreMul<T>(std::marker::PhantomData<T>);
impl<T: Ty> Map1 for PreMul<T> {
    type T = T;
    #[inline(always)]
    fn f(x: T::S, c: &Ctx<T>) -> T::S {
        T::store(T::mul(T::load(x), c.p))
    }
    #[inline(always)]
    fn f8(x: [T::S; 8], c: &Ctx<T>) -> [T::S; 8] {
        T::store8(T::load8(x).map(|v| T::mul(v, c.p)))
    }
}

/// `x / postdiv`.
pub(crate) struct PostDiv<T>(std::marker::PhantomData<T>);
impl<T: Ty> Map1 for PostDiv<T> {
    type T = T;
    #[inline(always)]
    fn f(x: T::S, c: &Ctx<T>) -> T::S {
        T::div(x, c.d)
    }
    #[inline(always)]
    fn f8(x: [T::S; 8], c: &Ctx<T>) -> [T::S; 8] {
        x.map(|v| T::div(v, c.d))
    }
}

/// `op(pre(x), y)`; with `P` the premultiplied value is rounded to the storage type first, so
/// the result is the same as a separate `prep` followed by a plain combine.
pub(crate) struct Combine<T, O, const P: bool>(std::marker::PhantomData<(T, O)>);
impl<T: Ty, O: Op, const P: bool> Map2 for Combine<T, O, P> {
    type T = T;
    #[inline(always)]
    fn f(x: T::S, y: T::S, c: &Ctx<T>) -> T::S {
        let x = if P {
            T::store(T::mul(T::load(x), c.p))
        } else {
            x
        };
        T::store(O::apply::<T>(T::load(x), T::load(y)))
    }
    #[inline(always)]
    fn f8(x: [T::S; 8], y: [T::S; 8], c: &Ctx<T>) -> [T::S; 8] {
        let x = if P {
            T::store8(T::load8(x).map(|v| T::mul(v, c.p)))
        } else {
            x
        };
        let (a, b) = (T::load8(x), T::load8(y));
        T::store8(std::array::from_fn(|i| O::apply::<T>(a[i], b[i])))
    }
}

/// Elements staged per chunk on the unaligned path.
const CHUNK: usize = 512;

#[inline(always)]
fn ctx<T: Ty>(p: &Params) -> Ctx<T> {
    Ctx {
        p: T::scalar(p.premul_bits),
        d: T::divisor(p.postdiv.max(1)),
    }
}

#[inline(always)]
fn aligned<S>(p: *const u8) -> bool {
    (p as usize).is_multiple_of(std::mem::align_of::<S>())
}

type S1<K> = <<K as Map1>::T as Ty>::S;
type S2<K> = <<K as Map2>::T as Ty>::S;

#[inline(always)]
fn a8<S: Copy>(s: &[S]) -> [S; 8] {
    std::array::from_fn(|i| s[i])
}

/// `d[i] = f(d[i])`.
#[inline(always)]
fn map1_in<K: Map1>(d: &mut [S1<K>], c: &Ctx<K::T>) {
    let mut rest: &mut [S1<K>] = d;
    if K::T::WIDE8 {
        let mut it = rest.chunks_exact_mut(8);
        for ch in &mut it {
            ch.copy_from_slice(&K::f8(a8(ch), c));
        }
        rest = it.into_remainder();
    }
    for v in rest.iter_mut() {
        *v = K::f(*v, c);
    }
}

/// `d[i] = f(s[i])`.
#[inline(always)]
fn map1<K: Map1>(d: &mut [S1<K>], s: &[S1<K>], c: &Ctx<K::T>) {
    let (mut d, mut s) = (d, s);
    if K::T::WIDE8 {
        let mut it = d.chunks_exact_mut(8);
        let mut is = s.chunks_exact(8);
        for (dc, sc) in (&mut it).zip(&mut is) {
            dc.copy_from_slice(&K::f8(a8(sc), c));
        }
        (d, s) = (it.into_remainder(), is.remainder());
    }
    for (d, s) in d.iter_mut().zip(s) {
        *d = K::f(*s, c);
    }
}

/// Which operand the destination slice also is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Alias {
    /// `d[i] = f(d[i], o[i])`.
    X,
    /// `d[i] = f(o[i], d[i])`.
    Y,
}

/// In place on one operand; `alias` is a constant after inlining.
#[inline(always)]
fn map2_in<K: Map2>(d: &mut [S2<K>], o: &[S2<K>], alias: Alias, c: &Ctx<K::T>) {
    let (mut d, mut o) = (d, o);
    if K::T::WIDE8 {
        let mut it = d.chunks_exact_mut(8);
        let mut io = o.chunks_exact(8);
        for (dc, oc) in (&mut it).zip(&mut io) {
            let r = match alias {
                Alias::X => K::f8(a8(dc), a8(oc), c),
                Alias::Y => K::f8(a8(oc), a8(dc), c),
            };
            dc.copy_from_slice(&r);
        }
        (d, o) = (it.into_remainder(), io.remainder());
    }
    for (d, o) in d.iter_mut().zip(o) {
        *d = match alias {
            Alias::X => K::f(*d, *o, c),
            Alias::Y => K::f(*o, *d, c),
        };
    }
}

/// `d[i] = f(d[i], d[i])`.
#[inline(always)]
fn map2_self<K: Map2>(d: &mut [S2<K>], c: &Ctx<K::T>) {
    let mut rest: &mut [S2<K>] = d;
    if K::T::WIDE8 {
        let mut it = rest.chunks_exact_mut(8);
        for ch in &mut it {
            let v = a8(ch);
            ch.copy_from_slice(&K::f8(v, v, c));
        }
        rest = it.into_remainder();
    }
    for v in rest.iter_mut() {
        *v = K::f(*v, *v, c);
    }
}

/// `d[i] = f(x[i], y[i])`.
#[inline(always)]
fn map2<K: Map2>(d: &mut [S2<K>], x: &[S2<K>], y: &[S2<K>], c: &Ctx<K::T>) {
    let (mut d, mut x, mut y) = (d, x, y);
    if K::T::WIDE8 {
        let mut it = d.chunks_exact_mut(8);
        let mut ix = x.chunks_exact(8);
        let mut iy = y.chunks_exact(8);
        for ((dc, xc), yc) in (&mut it).zip(&mut ix).zip(&mut iy) {
            dc.copy_from_slice(&K::f8(a8(xc), a8(yc), c));
        }
        (d, x, y) = (it.into_remainder(), ix.remainder(), iy.remainder());
    }
    for ((d, x), y) in d.iter_mut().zip(x).zip(y) {
        *d = K::f(*x, *y, c);
    }
}

/// # Safety
/// `dst`, `src` valid for `n` elements of `K::T`; equal or not overlapping.
#[inline(always)]
unsafe fn run1<K: Map1>(p: &Params, dst: *mut u8, src: *const u8, n: usize) {
    if n == 0 {
        return;
    }
    let c = ctx::<K::T>(p);
    if aligned::<S1<K>>(dst) && aligned::<S1<K>>(src) {
        // SAFETY: aligned and valid for n elements; when dst == src only the mutable slice
        // exists, otherwise (by the contract) the two do not overlap.
        unsafe {
            let d = std::slice::from_raw_parts_mut(dst as *mut S1<K>, n);
            if std::ptr::eq(dst, src) {
                map1_in::<K>(d, &c);
            } else {
                map1::<K>(d, std::slice::from_raw_parts(src as *const S1<K>, n), &c);
            }
        }
        return;
    }
    let sz = std::mem::size_of::<S1<K>>();
    let mut buf = [S1::<K>::default(); CHUNK];
    let mut i = 0;
    while i < n {
        let m = CHUNK.min(n - i);
        // SAFETY: element i..i+m of src is in bounds; buf is a distinct stack array.
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(i * sz), buf.as_mut_ptr() as *mut u8, m * sz)
        };
        map1_in::<K>(&mut buf[..m], &c);
        // SAFETY: as above, for dst; the chunk of src was read before it is overwritten.
        unsafe {
            std::ptr::copy_nonoverlapping(buf.as_ptr() as *const u8, dst.add(i * sz), m * sz)
        };
        i += m;
    }
}

/// # Safety
/// All valid for `n` elements of `K::T`; `dst` equals an input or overlaps neither.
#[inline(always)]
unsafe fn run2<K: Map2>(p: &Params, dst: *mut u8, x: *const u8, y: *const u8, n: usize) {
    if n == 0 {
        return;
    }
    let c = ctx::<K::T>(p);
    if aligned::<S2<K>>(dst) && aligned::<S2<K>>(x) && aligned::<S2<K>>(y) {
        // SAFETY (all arms): every pointer is aligned and valid for n elements; the mutable
        // slice is only made over memory no other live slice covers.
        unsafe {
            let d = std::slice::from_raw_parts_mut(dst as *mut S2<K>, n);
            let (dx, dy) = (std::ptr::eq(dst, x), std::ptr::eq(dst, y));
            if dx && dy {
                map2_self::<K>(d, &c);
            } else if dx {
                let ys = std::slice::from_raw_parts(y as *const S2<K>, n);
                map2_in::<K>(d, ys, Alias::X, &c);
            } else if dy {
                let xs = std::slice::from_raw_parts(x as *const S2<K>, n);
                map2_in::<K>(d, xs, Alias::Y, &c);
            } else {
                let xs = std::slice::from_raw_parts(x as *const S2<K>, n);
                let ys = std::slice::from_raw_parts(y as *const S2<K>, n);
                map2::<K>(d, xs, ys, &c);
            }
        }
        return;
    }
    let sz = std::mem::size_of::<S2<K>>();
    let mut bx = [S2::<K>::default(); CHUNK];
    let mut by = [S2::<K>::default(); CHUNK];
    let mut i = 0;
    while i < n {
        let m = CHUNK.min(n - i);
        // SAFETY: elements i..i+m of x and y are in bounds; bx/by are distinct stack arrays.
        unsafe {
            std::ptr::copy_nonoverlapping(x.add(i * sz), bx.as_mut_ptr() as *mut u8, m * sz);
            std::ptr::copy_nonoverlapping(y.add(i * sz), by.as_mut_ptr() as *mut u8, m * sz);
        }
        map2_in::<K>(&mut bx[..m], &by[..m], Alias::X, &c);
        // SAFETY: elements i..i+m of dst are in bounds; both inputs' chunks were already read.
        unsafe { std::ptr::copy_nonoverlapping(bx.as_ptr() as *const u8, dst.add(i * sz), m * sz) };
        i += m;
    }
}

pub(crate) type Fn1 = unsafe fn(&Params, *mut u8, *const u8, usize);
pub(crate) type Fn2 = unsafe fn(&Params, *mut u8, *const u8, *const u8, usize);

/// # Safety
/// As `run1`.
unsafe fn base1<K: Map1>(p: &Params, dst: *mut u8, src: *const u8, n: usize) {
    // SAFETY: forwarded contract.
    unsafe { run1::<K>(p, dst, src, n) }
}
/// # Safety
/// As `run2`.
unsafe fn base2<K: Map2>(p: &Params, dst: *mut u8, x: *const u8, y: *const u8, n: usize) {
    // SAFETY: forwarded contract.
    unsafe { run2::<K>(p, dst, x, y, n) }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    /// # Safety
    /// As `run1`, and the CPU supports AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn avx2_1<K: Map1>(p: &Params, dst: *mut u8, src: *const u8, n: usize) {
        // SAFETY: forwarded contract.
        unsafe { run1::<K>(p, dst, src, n) }
    }
    /// # Safety
    /// As `run2`, and the CPU supports AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn avx2_2<K: Map2>(
        p: &Params,
        dst: *mut u8,
        x: *const u8,
        y: *const u8,
        n: usize,
    ) {
        // SAFETY: forwarded contract.
        unsafe { run2::<K>(p, dst, x, y, n) }
    }
}

/// Whether the AVX2 (+F16C, which every AVX2 CPU has) instantiations may run here (checked
/// once per process by std).
#[inline]
pub(crate) fn have_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

pub(crate) fn pick1<K: Map1>(wide: bool) -> Fn1 {
    #[cfg(target_arch = "x86_64")]
    if wide {
        return avx2::avx2_1::<K>;
    }
    let _ = wide;
    base1::<K>
}

pub(crate) fn pick2<K: Map2>(wide: bool) -> Fn2 {
    #[cfg(target_arch = "x86_64")]
    if wide {
        return avx2::avx2_2::<K>;
    }
    let _ = wide;
    base2::<K>
}

/// `memmove` for `n` elements of `size` bytes (nothing when in place).
///
/// # Safety
/// Both valid for `n * size` bytes.
pub(crate) unsafe fn copy_bytes(size: usize, dst: *mut u8, src: *const u8, n: usize) {
    if n != 0 && !std::ptr::eq(dst, src) {
        // SAFETY: both valid for n * size bytes; `copy` allows overlap.
        unsafe { std::ptr::copy(src, dst, n * size) }
    }
}
