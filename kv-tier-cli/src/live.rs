//! Whether a root is in use: the marks the fs tier keeps on a root it has open
//! (`kv_tier_fs::offline::holders`). The commands that delete refuse on a root in use.

use std::path::Path;

use kv_tier::fs::offline::{Holder, holders};

/// The tiers that have `root` open on this machine.
pub(crate) fn live_holders(root: &Path) -> Result<Vec<Holder>, String> {
    Ok(holders(root)
        .map_err(|e| {
            format!(
                "{}: reading the marks of running tiers: {e}",
                root.display()
            )
        })?
        .into_iter()
        .filter(|h| h.live)
        .collect())
}

/// `Err` naming the holders when a tier has `root` open and `force` is not given (`what`:
/// the command, for the message); with `force`, a warning on stderr.
pub(crate) fn refuse_if_live(root: &Path, what: &str, force: bool) -> Result<(), String> {
    let live = match live_holders(root) {
        Ok(l) => l,
        Err(e) if force => {
            eprintln!("kv-tier: warning: {e}; {what} goes on (--force)");
            return Ok(());
        }
        Err(e) => return Err(format!("{e}; pass --force to go on without knowing")),
    };
    if live.is_empty() {
        return Ok(());
    }
    let who: Vec<String> = live.iter().map(|h| h.says.clone()).collect();
    if force {
        eprintln!(
            "kv-tier: warning: {} is in use by {} running tier(s) ({}); {what} goes on (--force)",
            root.display(),
            live.len(),
            who.join("; ")
        );
        return Ok(());
    }
    Err(format!(
        "{} is in use by {} running tier(s): {}. {what} would delete blocks they may be reading \
         (their loads would fail); stop them first, or pass --force",
        root.display(),
        live.len(),
        who.join("; ")
    ))
}
