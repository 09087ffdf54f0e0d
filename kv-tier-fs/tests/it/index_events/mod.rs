//! The index and the `BlockStored` / `BlockRemoved` events against the disk:
//!
//! - [`events`]: a key's last event says whether its file is there, each removal once;
//! - [`accounting`]: the index sums what `du` of the rank directory shows;
//! - [`answers`]: what the index answers for `holds`, against the disk;
//! - [`walks`]: the walk at open and rescans adopt what is on disk and repair drift.

mod accounting;
mod answers;
mod events;
mod walks;
