//! Live C handles: the address of a Rust object handed to C, mapped back to the object while it
//! is registered. Lookups never dereference an unknown pointer, so a destroyed or foreign handle
//! is reported, not followed. Every call of the API looks its handles up, so the map hashes an
//! address with one multiplication, not SipHash, and each thread remembers the handles it looked
//! up last ([`Recent`]): a thread calling on its communicators takes no lock.

use parking_lot::Mutex;
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::LocalKey;

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
    /// Handles removed so far: a remembered lookup is valid while this has not changed.
    removals: AtomicU64,
}

impl<T> Registry<T> {
    pub const fn new() -> Registry<T> {
        Registry {
            map: Mutex::new(None),
            removals: AtomicU64::new(0),
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
        let mut m = self.map.lock();
        let v = m.as_mut().and_then(|m| m.remove(&h));
        self.removals.fetch_add(1, Ordering::AcqRel);
        v
    }

    /// `get`, through the thread's memory of its last lookups (`recent`, a thread-local of the
    /// registry's user): no lock while no handle has been removed since. Where the thread-local
    /// is gone (calls from other thread-locals' destructors), plainly `get`.
    pub fn get_via(&self, recent: &'static LocalKey<Recent<T>>, h: usize) -> Option<Arc<T>> {
        recent
            .try_with(|r| self.get_recent(r, h))
            .unwrap_or_else(|_| self.get(h))
    }

    fn get_recent(&self, recent: &Recent<T>, h: usize) -> Option<Arc<T>> {
        let removals = self.removals.load(Ordering::Acquire);
        {
            let mut r = recent.0.borrow_mut();
            let hit = |e: &Option<(usize, u64, Weak<T>)>| matches!(e, Some((rh, rr, _)) if *rh == h && *rr == removals);
            // The entry found last first: a thread calls on the same handle over and over.
            let at = if hit(&r.seen[r.last]) {
                Some(r.last)
            } else {
                r.seen.iter().position(hit)
            };
            if let Some(at) = at {
                r.last = at;
                if let Some(v) = r.seen[at].as_ref().and_then(|(_, _, w)| w.upgrade()) {
                    return Some(v);
                }
            }
        }
        let v = self.get(h)?;
        let mut r = recent.0.borrow_mut();
        let at = r.next;
        r.seen[at] = Some((h, removals, Arc::downgrade(&v)));
        r.next = (at + 1) % RECENT;
        Some(v)
    }
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// Handles a thread remembers: a thread driving several ranks (one communicator and stream each)
/// alternates between them.
const RECENT: usize = 8;

struct Seen<T> {
    /// (handle, the registry's removals then, the object), weak so that it keeps nothing alive.
    seen: [Option<(usize, u64, Weak<T>)>; RECENT],
    /// The entry replaced next.
    next: usize,
    /// The entry found last.
    last: usize,
}

/// A thread's last lookups in a registry.
pub struct Recent<T>(RefCell<Seen<T>>);

impl<T> Recent<T> {
    pub const fn new() -> Recent<T> {
        Recent(RefCell::new(Seen {
            seen: [const { None }; RECENT],
            next: 0,
            last: 0,
        }))
    }
}

impl<T> Default for Recent<T> {
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

    #[test]
    fn recent_lookups_forget_removed_handles() {
        static R: Registry<u32> = Registry::new();
        let recent = Recent::new();
        let a = Arc::new(1u32);
        let b = Arc::new(2u32);
        let (ha, hb) = (R.insert(&a), R.insert(&b));
        assert!(Arc::ptr_eq(&R.get_recent(&recent, ha).expect("a"), &a));
        // Remembered: the same again, then another handle replaces it.
        assert!(Arc::ptr_eq(&R.get_recent(&recent, ha).expect("a"), &a));
        assert!(Arc::ptr_eq(&R.get_recent(&recent, hb).expect("b"), &b));
        assert!(Arc::ptr_eq(&R.get_recent(&recent, ha).expect("a"), &a));
        // Removed while remembered: reported, though the object still lives.
        R.remove(ha);
        assert!(R.get_recent(&recent, ha).is_none());
        assert!(R.get_recent(&recent, ha + 1).is_none());
        assert_eq!(*R.get_recent(&recent, hb).expect("b"), 2);
        // Re-registered at the same address: found again.
        assert_eq!(R.insert(&a), ha);
        assert_eq!(*R.get_recent(&recent, ha).expect("a again"), 1);
        // More handles than a thread remembers, in turn.
        let many: Vec<Arc<u32>> = (0..2 * RECENT as u32).map(|i| Arc::new(100 + i)).collect();
        let hs: Vec<usize> = many.iter().map(|m| R.insert(m)).collect();
        for _ in 0..3 {
            for (m, &h) in many.iter().zip(&hs) {
                assert!(Arc::ptr_eq(
                    &R.get_recent(&recent, h).expect("registered"),
                    m
                ));
            }
        }
        R.remove(hs[3]);
        assert!(R.get_recent(&recent, hs[3]).is_none());
        assert_eq!(*R.get_recent(&recent, hs[4]).expect("registered"), 104);
    }
}
