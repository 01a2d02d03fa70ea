//! Live C handles: the address of a Rust object handed to C, mapped back to the object while it
//! is registered. Lookups never dereference an unknown pointer, so a destroyed or foreign handle
//! is reported, not followed. Every call of the API looks its handles up, so the map hashes an
//! address with one multiplication, not SipHash.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

/// Hashes an address (a `usize` key): Fibonacci hashing, the high bits spread by one multiply.
#[derive(Default)]
pub struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_usize(&mut self, v: usize) {
        self.0 = (v as u64 ^ self.0)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(26);
    }
}

type Map<T> = HashMap<usize, Arc<T>, BuildHasherDefault<AddrHasher>>;

pub struct Registry<T> {
    map: Mutex<Option<Map<T>>>,
}

impl<T> Registry<T> {
    pub const fn new() -> Registry<T> {
        Registry {
            map: Mutex::new(None),
        }
    }

    /// Registers `v` under its address, which is its handle.
    pub fn insert(&self, v: &Arc<T>) -> usize {
        let h = Arc::as_ptr(v) as usize;
        self.map
            .lock()
            .get_or_insert_with(Map::default)
            .insert(h, v.clone());
        h
    }

    pub fn get(&self, h: usize) -> Option<Arc<T>> {
        self.map.lock().as_ref().and_then(|m| m.get(&h).cloned())
    }

    pub fn remove(&self, h: usize) -> Option<Arc<T>> {
        self.map.lock().as_mut().and_then(|m| m.remove(&h))
    }
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_forget() {
        let r = Registry::new();
        let objs: Vec<Arc<u32>> = (0..100).map(Arc::new).collect();
        let hs: Vec<usize> = objs.iter().map(|o| r.insert(o)).collect();
        for (o, &h) in objs.iter().zip(&hs) {
            assert!(Arc::ptr_eq(&r.get(h).expect("registered"), o));
        }
        assert!(r.get(hs[0] + 1).is_none());
        assert!(Arc::ptr_eq(&r.remove(hs[7]).expect("registered"), &objs[7]));
        assert!(r.get(hs[7]).is_none());
        assert!(r.remove(hs[7]).is_none());
        assert_eq!(*r.get(hs[8]).expect("still registered"), 8);
    }
}
