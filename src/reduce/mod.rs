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
