//! Element-wise reduction kernels for all 12 datatypes (interface stub).

use crate::types::Reduction;

pub struct Reducer {
    pub red: Reduction,
}

impl Reducer {
    pub fn new(red: Reduction) -> Reducer {
        Reducer { red }
    }
    /// `dst[i] = pre(src[i])`: a copy, or the PreMulSum multiplication.
    ///
    /// # Safety
    /// `dst` and `src` are valid for `count` elements; they are equal or do not overlap.
    pub unsafe fn prep(&self, _dst: *mut u8, _src: *const u8, _count: usize) {
        unimplemented!()
    }
    /// `dst[i] = pre(local[i]) op acc[i]`.
    ///
    /// # Safety
    /// All three valid for `count` elements; `dst` equals one of the inputs or overlaps neither.
    pub unsafe fn combine(&self, _dst: *mut u8, _local: *const u8, _acc: *const u8, _count: usize) {
        unimplemented!()
    }
    /// `dst[i] = post(src[i])`: a copy, or the integer average's division.
    ///
    /// # Safety
    /// As `prep`.
    pub unsafe fn finish(&self, _dst: *mut u8, _src: *const u8, _count: usize) {
        unimplemented!()
    }
}

/// Spoils element 0 (OXCCL_FAULT=corrupt). (stub)
///
/// # Safety
/// `ptr` valid for `count` elements of `dtype`.
pub unsafe fn fault_corrupt(_dtype: crate::types::DataType, ptr: *mut u8, count: usize) {
    if count > 0 {
        // SAFETY: per the contract.
        unsafe { *ptr ^= 1 };
    }
}

pub mod convert {
    pub fn f32_to_f16(_v: f32) -> u16 {
        unimplemented!()
    }
    pub fn f32_to_bf16(_v: f32) -> u16 {
        unimplemented!()
    }
    pub fn f32_to_e4m3(_v: f32) -> u8 {
        unimplemented!()
    }
    pub fn f32_to_e5m2(_v: f32) -> u8 {
        unimplemented!()
    }
}
