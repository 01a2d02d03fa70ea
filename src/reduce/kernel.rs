//! Monomorphised element-wise loops. One instantiation per (datatype, operation, options), each
//! compiled twice on x86_64 (baseline SSE2 and AVX2) and picked once by `Reducer::new`.
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
}
/// An element-wise binary map (`x` = local, `y` = accumulator).
pub(crate) trait Map2: 'static {
    type T: Ty;
    fn f(x: <Self::T as Ty>::S, y: <Self::T as Ty>::S, c: &Ctx<Self::T>) -> <Self::T as Ty>::S;
}

/// `x * premul`, rounded back to the storage type.
pub(crate) struct PreMul<T>(std::marker::PhantomData<T>);
impl<T: Ty> Map1 for PreMul<T> {
    type T = T;
    #[inline(always)]
    fn f(x: T::S, c: &Ctx<T>) -> T::S {
        T::store(T::mul(T::load(x), c.p))
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

/// # Safety
/// `dst`, `src` valid for `n` elements of `K::T`; equal or not overlapping.
#[inline(always)]
unsafe fn run1<K: Map1>(p: &Params, dst: *mut u8, src: *const u8, n: usize) {
    type S<K> = <<K as Map1>::T as Ty>::S;
    if n == 0 {
        return;
    }
    let c = ctx::<K::T>(p);
    if aligned::<S<K>>(dst) && aligned::<S<K>>(src) {
        if std::ptr::eq(dst, src) {
            // SAFETY: aligned, valid for n elements, and the only reference to this memory.
            let d = unsafe { std::slice::from_raw_parts_mut(dst as *mut S<K>, n) };
            for v in d.iter_mut() {
                *v = K::f(*v, &c);
            }
        } else {
            // SAFETY: aligned, valid for n elements, and (by the contract) not overlapping.
            let (d, s) = unsafe {
                (
                    std::slice::from_raw_parts_mut(dst as *mut S<K>, n),
                    std::slice::from_raw_parts(src as *const S<K>, n),
                )
            };
            for (d, s) in d.iter_mut().zip(s) {
                *d = K::f(*s, &c);
            }
        }
        return;
    }
    let sz = std::mem::size_of::<S<K>>();
    let mut buf = [S::<K>::default(); CHUNK];
    let mut i = 0;
    while i < n {
        let m = CHUNK.min(n - i);
        // SAFETY: element i..i+m of src is in bounds; buf is a distinct stack array.
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(i * sz), buf.as_mut_ptr() as *mut u8, m * sz)
        };
        for v in buf[..m].iter_mut() {
            *v = K::f(*v, &c);
        }
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
    type S<K> = <<K as Map2>::T as Ty>::S;
    if n == 0 {
        return;
    }
    let c = ctx::<K::T>(p);
    let dc = dst as *const u8;
    if aligned::<S<K>>(dst) && aligned::<S<K>>(x) && aligned::<S<K>>(y) {
        // SAFETY (all four arms): every pointer is aligned and valid for n elements; a mutable
        // slice is only made over memory no other live slice covers.
        unsafe {
            if dc == x && dc == y {
                let d = std::slice::from_raw_parts_mut(dst as *mut S<K>, n);
                for v in d.iter_mut() {
                    *v = K::f(*v, *v, &c);
                }
            } else if dc == x {
                let d = std::slice::from_raw_parts_mut(dst as *mut S<K>, n);
                let ys = std::slice::from_raw_parts(y as *const S<K>, n);
                for (d, y) in d.iter_mut().zip(ys) {
                    *d = K::f(*d, *y, &c);
                }
            } else if dc == y {
                let d = std::slice::from_raw_parts_mut(dst as *mut S<K>, n);
                let xs = std::slice::from_raw_parts(x as *const S<K>, n);
                for (d, x) in d.iter_mut().zip(xs) {
                    *d = K::f(*x, *d, &c);
                }
            } else {
                let d = std::slice::from_raw_parts_mut(dst as *mut S<K>, n);
                let xs = std::slice::from_raw_parts(x as *const S<K>, n);
                let ys = std::slice::from_raw_parts(y as *const S<K>, n);
                for ((d, x), y) in d.iter_mut().zip(xs).zip(ys) {
                    *d = K::f(*x, *y, &c);
                }
            }
        }
        return;
    }
    let sz = std::mem::size_of::<S<K>>();
    let mut bx = [S::<K>::default(); CHUNK];
    let mut by = [S::<K>::default(); CHUNK];
    let mut i = 0;
    while i < n {
        let m = CHUNK.min(n - i);
        // SAFETY: elements i..i+m of x and y are in bounds; bx/by are distinct stack arrays.
        unsafe {
            std::ptr::copy_nonoverlapping(x.add(i * sz), bx.as_mut_ptr() as *mut u8, m * sz);
            std::ptr::copy_nonoverlapping(y.add(i * sz), by.as_mut_ptr() as *mut u8, m * sz);
        }
        for (a, b) in bx[..m].iter_mut().zip(&by[..m]) {
            *a = K::f(*a, *b, &c);
        }
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
    /// As `run1`, and the CPU supports AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn avx2_1<K: Map1>(p: &Params, dst: *mut u8, src: *const u8, n: usize) {
        // SAFETY: forwarded contract.
        unsafe { run1::<K>(p, dst, src, n) }
    }
    /// # Safety
    /// As `run2`, and the CPU supports AVX2.
    #[target_feature(enable = "avx2")]
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

/// Whether the AVX2 instantiations may run here (checked once per process by std).
#[inline]
pub(crate) fn have_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
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
