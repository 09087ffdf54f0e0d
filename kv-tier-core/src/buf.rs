//! Block buffers handed to I/O code: read-only [`BlockSource`]s for stores, writable
//! [`BlockSink`]s for loads. Both are owned, `Send`, and keep their memory (a DRAM slot, or
//! a buffer of their own) alive and pinned until dropped.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use bytes::Bytes;

/// The alignment of [`AlignedBuf`]s: a page.
pub const PAGE_SIZE: usize = 4096;

/// A zero-initialised heap buffer aligned to a page (usable for `O_DIRECT`).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Option<Layout>,
}

// SAFETY: AlignedBuf owns its allocation exclusively; &AlignedBuf only reads it.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references give read-only access.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes, page aligned.
    pub fn zeroed(len: usize) -> Self {
        if len == 0 {
            return Self {
                ptr: NonNull::<u64>::dangling().cast(),
                len: 0,
                layout: None,
            };
        }
        let layout = Layout::from_size_align(len, PAGE_SIZE).expect("buffer size overflows");
        // SAFETY: layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self {
            ptr,
            len,
            layout: Some(layout),
        }
    }

    /// A page-aligned copy of `data`.
    pub fn copy_from(data: &[u8]) -> Self {
        let mut b = Self::zeroed(data.len());
        b.as_mut_slice().copy_from_slice(data);
        b
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes (or dangling with len 0) while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            // SAFETY: allocated with this layout in `zeroed`.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

/// The bytes of one block to be stored: a zero-copy view of a DRAM slot (or any bytes).
///
/// Converting to [`Bytes`] ([`BlockSource::bytes`]) does not copy; the slot stays pinned
/// until the source and every `Bytes` made from it are dropped.
#[derive(Clone)]
pub struct BlockSource {
    bytes: Bytes,
}

impl BlockSource {
    /// A source over `bytes`.
    pub fn from_bytes(bytes: impl Into<Bytes>) -> Self {
        Self {
            bytes: bytes.into(),
        }
    }

    /// A source over an owner of bytes (kept alive, and so pinned, until the last view drops).
    pub fn from_owner<T: AsRef<[u8]> + Send + 'static>(owner: T) -> Self {
        Self {
            bytes: Bytes::from_owner(owner),
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes
    }

    /// A zero-copy `Bytes` view.
    pub fn bytes(&self) -> Bytes {
        self.bytes.clone()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the block is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Whether the start address is a multiple of `align` (for `O_DIRECT`).
    pub fn is_aligned(&self, align: usize) -> bool {
        (self.bytes.as_ptr() as usize).is_multiple_of(align)
    }
}

impl fmt::Debug for BlockSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockSource")
            .field("len", &self.bytes.len())
            .finish()
    }
}

/// A writable buffer for one block being loaded: a reserved DRAM slot (or a buffer of its own).
///
/// Exclusive: nobody else reads or writes the memory while the sink lives.
pub struct BlockSink {
    ptr: NonNull<u8>,
    len: usize,
    _owner: Box<dyn Send + Sync>,
}

// SAFETY: the sink has exclusive access to its memory (constructor contract), and the owner is Send.
unsafe impl Send for BlockSink {}

impl BlockSink {
    /// A sink over a fresh page-aligned buffer, plus the reader that gets the bytes back once
    /// the sink is dropped.
    ///
    /// ```
    /// use kv_tier_core::BlockSink;
    /// let (mut sink, reader) = BlockSink::pair(4);
    /// sink.as_mut_slice().copy_from_slice(b"abcd");
    /// drop(sink);
    /// assert_eq!(&reader.into_bytes().unwrap()[..], b"abcd");
    /// ```
    pub fn pair(len: usize) -> (BlockSink, SinkReader) {
        let mut buf = AlignedBuf::zeroed(len);
        let ptr = NonNull::new(buf.as_mut_slice().as_mut_ptr()).expect("non-null");
        let buf = Arc::new(buf);
        let sink = BlockSink {
            ptr,
            len,
            _owner: Box::new(buf.clone()),
        };
        (sink, SinkReader { buf })
    }

    /// A sink over `len` bytes at `ptr`, keeping `owner` alive until dropped.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes for as long as `owner` lives,
    /// and nothing else may access that memory until the sink (and so `owner`) is dropped.
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        len: usize,
        owner: Box<dyn Send + Sync>,
    ) -> Self {
        Self {
            ptr,
            len,
            _owner: owner,
        }
    }

    /// The buffer, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: exclusive, valid memory per the constructor contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The buffer, read-only.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the start address is a multiple of `align` (for `O_DIRECT`).
    pub fn is_aligned(&self, align: usize) -> bool {
        (self.ptr.as_ptr() as usize).is_multiple_of(align)
    }
}

impl fmt::Debug for BlockSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockSink").field("len", &self.len).finish()
    }
}

/// Gets the bytes of a [`BlockSink::pair`] back once the sink is gone.
#[derive(Debug)]
pub struct SinkReader {
    buf: Arc<AlignedBuf>,
}

impl SinkReader {
    /// The bytes, if the sink has been dropped; otherwise the reader back.
    pub fn into_bytes(self) -> Result<Bytes, SinkReader> {
        match Arc::try_unwrap(self.buf) {
            Ok(buf) => Ok(Bytes::from_owner(buf)),
            Err(buf) => Err(SinkReader { buf }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let b = AlignedBuf::zeroed(10_000);
        assert!((b.as_slice().as_ptr() as usize).is_multiple_of(PAGE_SIZE));
        assert!(b.as_slice().iter().all(|&x| x == 0));
        assert!(AlignedBuf::zeroed(0).is_empty());
    }

    #[test]
    fn reader_waits_for_sink() {
        let (mut sink, reader) = BlockSink::pair(3);
        assert!(sink.is_aligned(PAGE_SIZE));
        sink.as_mut_slice().copy_from_slice(b"xyz");
        let reader = reader.into_bytes().unwrap_err();
        drop(sink);
        assert_eq!(&reader.into_bytes().unwrap()[..], b"xyz");
    }

    #[test]
    fn source_views_share_memory() {
        let s = BlockSource::from_owner(AlignedBuf::copy_from(b"hello"));
        assert!(s.is_aligned(PAGE_SIZE));
        assert_eq!(s.bytes().as_ptr(), s.as_slice().as_ptr());
    }
}
