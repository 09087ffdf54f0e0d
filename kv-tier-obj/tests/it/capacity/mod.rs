//! The bound (`max_size_gb`): what the index counts, what a sweep deletes and when, and the
//! recency order it follows across restarts.
//!
//! - `count`: the count follows what is there (never under it), through failed PUTs,
//!   damaged objects, late answers and vanished victims;
//! - `sweep`: the sweep deletes the oldest unprotected keys down to the low watermark, and
//!   stores, lookups and loads racing its DELETEs;
//! - `recency`: the recency order saved at shutdown (per rank), touches surviving a restart, a
//!   garbled snapshot;
//! - `take_back`: a store of a victim whose DELETE is not sent takes it back.

mod count;
mod recency;
mod sweep;
mod take_back;
