//! The obj tier's integration tests, one binary: `ObjTier` through its public API on a
//! controlled in-memory store, on the S3 test server (directly and behind a misbehaving
//! proxy), and as several processes sharing one bucket.
//!
//! - `store_load`: stores and loads at the edges of the API;
//! - `requests`: what the tier asks of its store (one PUT, one HEAD, looking first);
//! - `existence`: what `lookup` answers (HEADs, the cache and its invalidation, the listing,
//!   deadlines);
//! - `removals`: no removal hidden by an older answer, no store skipped on one;
//! - `integrity`: no wrong bytes served (checksums, sizes, broken bodies, damaged objects);
//! - `faults`: server errors, dropped connections, hangs and deadlines;
//! - `events`: the stored and removed events say what is there;
//! - `cancellation`: futures dropped anywhere leave nothing behind;
//! - `shutdown`: shutdown with sweeps and requests in flight, twice, and after;
//! - `capacity`: the bound (`max_size_gb`): the count, the sweep, the recency order;
//! - `shared`: the shared bucket: bound, lease, credit, records, members, processes;
//! - `config`: options refused naming their field, opening, the startup probe;
//! - `layout`: object keys in vLLM's layout, interop with aws-sdk-s3;
//! - `conformance`: the testkit's conformance suite (in memory, bounded, on S3);
//! - `support`: this binary's helpers.

mod cancellation;
mod capacity;
mod config;
mod conformance;
mod events;
mod existence;
mod faults;
mod integrity;
mod layout;
mod removals;
mod requests;
mod shared;
mod shutdown;
mod store_load;
mod support;
