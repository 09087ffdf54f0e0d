//! The `kv-tier` command driven as an operator would, and given what an operator might give it
//! by mistake (or a damaged cache directory gives it): cache directories written by the fs
//! tier (with damage, strays and ages planted behind its back), config files, its S3 server.
//! Promises: exit 0 all well, 1 something wrong (with a message naming what), 2 usage error;
//! never a panic (exit 101 or "panicked" on stderr), never a hang, never a change outside ROOT.
//!
//! - `inspect`: what `inspect` reports of a root;
//! - `verify`: damage listed, and `--repair` removing only it;
//! - `gc`: the least recently used deleted down to the watermark, caps at the extremes;
//! - `deletion`: what `verify --repair` and `gc` may delete (nothing outside ROOT, nothing
//!   but files at the layout's paths, nothing without the namespace's layout unless forced);
//! - `in_use`: `gc` and `verify --repair` refusing a root a running tier has open;
//! - `roots`: the commands on paths that are no cache directory, FIFOs, garbage, odd names;
//! - `config_check`: `config check` on good, bad, extreme and no-config files;
//! - `usage`: arguments refused as usage errors;
//! - `s3_server`: the S3 server serving the obj tier and serve_sim, and its refusals;
//! - `support`: this binary's helpers.

mod config_check;
mod deletion;
mod gc;
mod in_use;
mod inspect;
mod roots;
mod s3_server;
mod support;
mod usage;
mod verify;
