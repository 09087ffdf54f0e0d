//! A secondary tier's own statistics as [`SecondaryTier::stats`](crate::SecondaryTier::stats)
//! reports them: flat figures for metrics exporters, and the snapshot that carries them.

use super::BlockStats;

/// One number of a tier's statistics, flat, for metrics exporters: a name unique within the
/// tier (`snake_case`, nested statistics joined with `_`: `gc_swept_files`), the doc comment
/// of its field as help, and whether it only grows.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Figure {
    /// The name, unique within the tier.
    pub name: String,
    /// What it counts (the field's doc comment).
    pub help: String,
    /// Counter (only grows) or gauge.
    pub kind: FigureKind,
    /// Its value now (`bool`s are 0 or 1).
    pub value: u64,
}

/// Whether a [`Figure`] only grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FigureKind {
    /// Only grows while the tier is open (events counted).
    Counter,
    /// A level now (bytes held, entries, flags).
    Gauge,
}

impl Figure {
    /// A figure; `help` is trimmed and its whitespace runs made single spaces.
    pub fn new(name: String, help: &str, kind: FigureKind, value: u64) -> Self {
        Self {
            name,
            help: help.split_whitespace().collect::<Vec<_>>().join(" "),
            kind,
            value,
        }
    }
}

/// `prefix_name`, or `name` alone when `prefix` is empty.
pub fn figure_name(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}_{name}")
    }
}

/// Statistics that list themselves as flat [`Figure`]s (the [`counters!`](crate::counters)
/// macro implements it for the types it declares; numbers and flags are gauges, an absent
/// `Option` lists nothing).
pub trait Figures {
    /// Appends this value's figures, named `name` (or, for a struct, its fields named under
    /// the prefix `name`), with `help` for a single number.
    fn figures(&self, name: &str, help: &str, out: &mut Vec<Figure>);
}

impl Figures for u64 {
    fn figures(&self, name: &str, help: &str, out: &mut Vec<Figure>) {
        out.push(Figure::new(name.into(), help, FigureKind::Gauge, *self));
    }
}

impl Figures for usize {
    fn figures(&self, name: &str, help: &str, out: &mut Vec<Figure>) {
        out.push(Figure::new(
            name.into(),
            help,
            FigureKind::Gauge,
            *self as u64,
        ));
    }
}

impl Figures for bool {
    fn figures(&self, name: &str, help: &str, out: &mut Vec<Figure>) {
        out.push(Figure::new(
            name.into(),
            help,
            FigureKind::Gauge,
            u64::from(*self),
        ));
    }
}

impl<T: Figures> Figures for Option<T> {
    fn figures(&self, name: &str, help: &str, out: &mut Vec<Figure>) {
        if let Some(v) = self {
            v.figures(name, help, out);
        }
    }
}

/// A secondary tier's own statistics, as [`SecondaryTier::stats`](crate::SecondaryTier::stats)
/// reports them: what every block-storing tier counts, its occupancy and bound where it has
/// one, and its own figures, both flat (for metrics) and as its statistics type serialises
/// them (for reports and scripts).
///
/// ```
/// use kv_tier_core::stats::{FigureKind, TierSnapshot};
/// kv_tier_core::counters! {
///     /// What my tier did.
///     #[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
///     pub struct MyStats;
///     /// The live counters behind [`MyStats`].
///     pub struct MyCounters;
///     fields {
///         /// Entries held now.
///         entries: u64,
///     }
///     counted {
///         /// Requests sent.
///         requests,
///     }
/// }
/// let mut mine = MyStats { entries: 3, ..Default::default() };
/// mine.requests = 5;
/// let snap = TierSnapshot::new("mine", Default::default(), &mine);
/// assert_eq!(snap.figures[0].name, "entries");
/// assert_eq!(snap.figures[0].kind, FigureKind::Gauge);
/// assert_eq!((snap.figures[1].name.as_str(), snap.figures[1].value), ("requests", 5));
/// assert_eq!(snap.figures[1].help, "Requests sent.");
/// assert_eq!(snap.detail["entries"], 3);
/// ```
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct TierSnapshot {
    /// The tier's type (`"fs"`, `"obj"`, a custom tier's own); empty for a tier that reports
    /// no statistics.
    pub kind: String,
    /// What every block-storing tier counts (zero for a tier that does not).
    pub blocks: BlockStats,
    /// Bytes the tier holds now, where it counts them (bounded tiers).
    pub used_bytes: Option<u64>,
    /// The bound on `used_bytes`, if the tier has one.
    pub capacity_bytes: Option<u64>,
    /// The tier's own figures, flat (the block counters above are not repeated here).
    pub figures: Vec<Figure>,
    /// The tier's own statistics as its statistics type serialises them (e.g. `FsStats`).
    pub detail: serde_json::Value,
}

impl TierSnapshot {
    /// A snapshot of a tier of type `kind` with the block counters `blocks` and its own
    /// statistics `own` (figures named by [`Figures`]; any named `blocks_...` are the block
    /// counters again, and are left out).
    pub fn new<S: Figures + serde::Serialize>(kind: &str, blocks: BlockStats, own: &S) -> Self {
        let mut figures = Vec::new();
        own.figures("", "", &mut figures);
        figures.retain(|f| !f.name.starts_with("blocks_"));
        Self {
            kind: kind.into(),
            blocks,
            used_bytes: None,
            capacity_bytes: None,
            figures,
            detail: serde_json::to_value(own).unwrap_or(serde_json::Value::Null),
        }
    }

    /// Sets the occupancy and the bound.
    pub fn with_usage(mut self, used_bytes: u64, capacity_bytes: Option<u64>) -> Self {
        self.used_bytes = Some(used_bytes);
        self.capacity_bytes = capacity_bytes;
        self
    }
}
