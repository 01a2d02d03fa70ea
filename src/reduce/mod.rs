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
