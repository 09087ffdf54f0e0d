//! The DRAM region: one anonymous mapping cut into page-aligned slots, pre-faulted, with a
//! pin count per slot that I/O handles hold.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use kv_tier_core::{BlockSink, BlockSource, Error, PAGE_SIZE, Result};

pub(crate) struct Region {
    base: NonNull<u8>,
    len: usize,
    slot_size: usize,
    block_size: usize,
    pins: Box<[AtomicU32]>,
    writers: Box<[AtomicBool]>,
}

// SAFETY: the mapping is shared memory whose per-slot access is coordinated by the tier's
// state machine (exclusive writer while Writing, shared readers while Ready) and pin counts.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    pub(crate) fn new(n_slots: usize, block_size: usize, prefault: bool) -> Result<Self> {
        let slot_size = block_size.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let len = slot_size
            .checked_mul(n_slots)
            .ok_or_else(|| Error::config("cpu_bytes_to_use", "region size overflows"))?;
        // SAFETY: anonymous private mapping; arguments are valid.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io(
                "mmap",
                format!("<{len} bytes of DRAM for cpu_bytes_to_use>"),
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: ptr/len is the mapping just made. Huge pages are a hint; errors are ignored.
        unsafe {
            libc::madvise(ptr, len, libc::MADV_HUGEPAGE);
        }
        if prefault {
            // First-touch page faults run at a fraction of memcpy speed: take them now.
            // SAFETY: as above; MADV_POPULATE_WRITE (Linux 5.14+) faults the range in.
            let rc = unsafe {
                libc::madvise(ptr, len, 23 /* MADV_POPULATE_WRITE */)
            };
            if rc != 0 {
                let base = ptr as *mut u8;
                for off in (0..len).step_by(PAGE_SIZE) {
                    // SAFETY: off < len, inside the mapping.
                    unsafe { std::ptr::write_volatile(base.add(off), 0) };
                }
            }
        }
        Ok(Self {
            base: NonNull::new(ptr as *mut u8).expect("mmap returned null"),
            len,
            slot_size,
            block_size,
            pins: (0..n_slots).map(|_| AtomicU32::new(0)).collect(),
            writers: (0..n_slots).map(|_| AtomicBool::new(false)).collect(),
        })
    }

    pub(crate) fn slot_size(&self) -> usize {
        self.slot_size
    }

    pub(crate) fn pins(&self, slot: usize) -> u32 {
        self.pins[slot].load(Ordering::Acquire)
    }

    pub(crate) fn writer_alive(&self, slot: usize) -> bool {
        self.writers[slot].load(Ordering::Acquire)
    }

    fn slot_ptr(&self, slot: usize) -> NonNull<u8> {
        debug_assert!((slot + 1) * self.slot_size <= self.len);
        // SAFETY: slot < n_slots, so the offset is inside the mapping.
        unsafe { NonNull::new_unchecked(self.base.as_ptr().add(slot * self.slot_size)) }
    }

    /// An exclusive writable view of a slot. The caller (the tier's state machine) guarantees
    /// the slot is in the Writing state and no other handle to it exists.
    pub(crate) fn sink(self: &Arc<Self>, slot: usize) -> BlockSink {
        self.writers[slot].store(true, Ordering::Release);
        let pin = Pin::new(self.clone(), slot, true);
        // SAFETY: the slot is valid for block_size bytes while the region (held by `pin`)
        // lives, and the state machine hands out one sink per Writing slot and no readers.
        unsafe { BlockSink::from_raw_parts(self.slot_ptr(slot), self.block_size, Box::new(pin)) }
    }

    /// A shared read-only view of a Ready slot, pinning it until every view is dropped.
    pub(crate) fn source(self: &Arc<Self>, slot: usize) -> BlockSource {
        BlockSource::from_owner(SlotView {
            ptr: self.slot_ptr(slot),
            len: self.block_size,
            _pin: Pin::new(self.clone(), slot, false),
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping made in `new`; no handle outlives the region (each
        // holds an Arc to it).
        unsafe {
            libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.len);
        }
    }
}

/// Holds a slot's pin count up while alive.
struct Pin {
    region: Arc<Region>,
    slot: usize,
    writer: bool,
}

impl Pin {
    fn new(region: Arc<Region>, slot: usize, writer: bool) -> Self {
        region.pins[slot].fetch_add(1, Ordering::AcqRel);
        Self {
            region,
            slot,
            writer,
        }
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        if self.writer {
            self.region.writers[self.slot].store(false, Ordering::Release);
        }
        self.region.pins[self.slot].fetch_sub(1, Ordering::AcqRel);
    }
}

struct SlotView {
    ptr: NonNull<u8>,
    len: usize,
    _pin: Pin,
}

// SAFETY: the view reads a Ready slot that cannot be written or reused while pinned.
unsafe impl Send for SlotView {}

impl AsRef<[u8]> for SlotView {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: valid for len bytes while the pin holds the region and the slot.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}
