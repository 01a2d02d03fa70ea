//! Copies into the caller's output buffers. Large outputs are written with streaming
//! (non-temporal) stores: they go to memory without first reading each destination line into the
//! cache (a write-allocate would double the memory traffic of an output that does not fit in the
//! cache anyway), and they do not evict the FIFO slots and inputs that are still being used.

/// Copies `bytes` bytes; `stream`: with streaming stores where the CPU has them. Equal pointers
/// are a no-op.
///
/// # Safety
/// Both ranges are valid for `bytes` bytes and equal or disjoint.
#[inline]
pub(crate) unsafe fn copy_out(dst: *mut u8, src: *const u8, bytes: usize, stream: bool) {
    if bytes == 0 || std::ptr::eq(dst, src) {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if stream && bytes >= 256 {
        // SAFETY: per the contract.
        unsafe { stream_copy(dst, src, bytes) };
        return;
    }
    let _ = stream;
    // SAFETY: per the contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) };
}

/// Copies a few bytes (an eager operation's tiny input) in words, without calling `memcpy`.
///
/// # Safety
/// Both ranges are valid for `bytes` bytes and disjoint.
#[inline]
pub(crate) unsafe fn copy_tiny(dst: *mut u8, src: *const u8, bytes: usize) {
    let mut i = 0;
    // SAFETY: every access stays below `bytes`; unaligned reads and writes.
    unsafe {
        while i + 8 <= bytes {
            let w = src.add(i).cast::<u64>().read_unaligned();
            dst.add(i).cast::<u64>().write_unaligned(w);
            i += 8;
        }
        while i < bytes {
            *dst.add(i) = *src.add(i);
            i += 1;
        }
    }
}

/// SSE2 streaming copy (SSE2 is part of x86-64): an ordinary copy up to the first 16-byte
/// aligned destination address, 64 bytes per iteration with `movntdq`, an ordinary tail, and a
/// store fence so that the data is visible before whatever the caller publishes next.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(dst: *mut u8, src: *const u8, bytes: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let head = dst.align_offset(16).min(bytes);
    // SAFETY: all offsets stay below `bytes`; unaligned loads, aligned streaming stores.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let (mut d, mut s) = (dst.add(head), src.add(head));
        let mut left = bytes - head;
        while left >= 64 {
            let a = _mm_loadu_si128(s as *const __m128i);
            let b = _mm_loadu_si128(s.add(16) as *const __m128i);
            let c = _mm_loadu_si128(s.add(32) as *const __m128i);
            let e = _mm_loadu_si128(s.add(48) as *const __m128i);
            _mm_stream_si128(d as *mut __m128i, a);
            _mm_stream_si128(d.add(16) as *mut __m128i, b);
            _mm_stream_si128(d.add(32) as *mut __m128i, c);
            _mm_stream_si128(d.add(48) as *mut __m128i, e);
            d = d.add(64);
            s = s.add(64);
            left -= 64;
        }
        while left >= 16 {
            _mm_stream_si128(d as *mut __m128i, _mm_loadu_si128(s as *const __m128i));
            d = d.add(16);
            s = s.add(16);
            left -= 16;
        }
        std::ptr::copy_nonoverlapping(s, d, left);
        _mm_sfence();
    }
}

#[cfg(test)]
mod tests {
    use super::copy_out;

    #[test]
    fn every_offset_and_length_copies_exactly() {
        let src: Vec<u8> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        for stream in [false, true] {
            for so in 0..17 {
                for d_off in 0..17 {
                    for len in [0, 1, 15, 16, 63, 64, 255, 256, 257, 1000, 4093] {
                        let mut dst = vec![0xAAu8; 4200];
                        // SAFETY: both ranges in bounds, distinct vectors.
                        unsafe {
                            copy_out(
                                dst.as_mut_ptr().add(d_off),
                                src.as_ptr().add(so),
                                len,
                                stream,
                            )
                        };
                        assert!(dst[..d_off].iter().all(|&b| b == 0xAA));
                        assert_eq!(&dst[d_off..d_off + len], &src[so..so + len]);
                        assert!(dst[d_off + len..].iter().all(|&b| b == 0xAA));
                    }
                }
            }
        }
    }
}
