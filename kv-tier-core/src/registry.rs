//! The tier registry: from a `type` name in the config to a builder, so tiers from other
//! crates plug in by name through the same config JSON.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

use crate::config::TierSpec;
use crate::error::{Error, Result};
use crate::layout::Namespace;
use crate::tier::SecondaryTier;

/// What a tier builder gets besides its own options.
#[derive(Debug, Clone)]
pub struct BuildContext {
    /// The tier's name (from `name`, defaulting to the type).
    pub name: String,
    /// Bytes per block.
    pub block_size: usize,
    /// The namespace, when one is configured.
    pub namespace: Option<Namespace>,
    /// The runtime the manager runs jobs on.
    pub runtime: tokio::runtime::Handle,
}

impl BuildContext {
    /// The namespace, or an error naming `layout` for tiers that need one.
    pub fn require_namespace(&self) -> Result<&Namespace> {
        self.namespace.as_ref().ok_or_else(|| {
            Error::config(
                "layout",
                format!(
                    "tier `{}` persists blocks and needs the run fields: add a \"layout\" object to the config or pass a namespace to the builder",
                    self.name
                ),
            )
        })
    }

    /// Runs a blocking `open` (directories, files, a capability probe) on the runtime's
    /// blocking pool, never on an async worker. A panic in it is an error naming the tier.
    pub async fn open_blocking<T, F>(&self, open: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T> + Send + 'static,
    {
        let task = self.runtime.spawn_blocking(open);
        task.await.map_err(|e| self.panicked("opening", e))?
    }

    /// Runs `connect` as a task on the manager's runtime (a network client's I/O must live
    /// on the runtime its requests will run on). A panic in it is an error naming the tier.
    pub async fn connect_on_runtime<T, F>(&self, connect: F) -> Result<T>
    where
        T: Send + 'static,
        F: std::future::Future<Output = Result<T>> + Send + 'static,
    {
        let task = self.runtime.spawn(connect);
        task.await.map_err(|e| self.panicked("connecting", e))?
    }

    fn panicked(&self, what: &str, e: tokio::task::JoinError) -> Error {
        Error::Backend {
            tier: self.name.clone(),
            message: format!("{what} the tier panicked: {e}"),
            transient: false,
        }
    }
}

/// A registered tier's options as the tier will use them: serialised, with the defaults it
/// fills in for what a config leaves out (what `kv-tier config check` prints).
///
/// ```
/// use kv_tier_core::registry::EffectiveOptions;
/// #[derive(serde::Serialize)]
/// struct Mine {
///     depth: Option<u32>,
/// }
/// impl EffectiveOptions for Mine {
///     fn effective_options(&self) -> (serde_json::Value, Vec<&'static str>) {
///         let mut v = serde_json::to_value(self).expect("serialises");
///         if self.depth.is_none() {
///             v["depth"] = 4.into(); // the default the tier uses
///             return (v, vec!["depth"]);
///         }
///         (v, Vec::new())
///     }
/// }
/// let (v, filled) = Mine { depth: None }.effective_options();
/// assert_eq!((v["depth"].as_u64(), filled), (Some(4), vec!["depth"]));
/// ```
pub trait EffectiveOptions: serde::Serialize {
    /// Other names a tier entry may give an option by (`(alias, key)`: vLLM's spelling of
    /// it), so that an option given by its alias is not taken for a default.
    const ALIASES: &'static [(&'static str, &'static str)] = &[];

    /// The options, defaults filled in, and the keys it filled. By default: as serialised,
    /// none filled (a config type whose every field is its effective value).
    fn effective_options(&self) -> (serde_json::Value, Vec<&'static str>) {
        (
            serde_json::to_value(self).unwrap_or(serde_json::Value::Null),
            Vec::new(),
        )
    }
}

/// The options of `cfg` as its tier uses them, and which of them take their defaults: those
/// it filled in, and every other one (not null) the entry `given` does not set, at its top
/// level, in a nested object (vLLM's `store_config`) or by an alias.
fn effective_of<C: EffectiveOptions>(
    cfg: &C,
    given: &serde_json::Map<String, serde_json::Value>,
) -> (serde_json::Value, Vec<String>) {
    let (v, filled) = cfg.effective_options();
    let set = |key: &str| {
        let here = |k: &str| {
            given.contains_key(k)
                || given
                    .values()
                    .any(|n| n.as_object().is_some_and(|n| n.contains_key(k)))
        };
        here(key) || C::ALIASES.iter().any(|(a, k)| *k == key && here(a))
    };
    let mut defaults: Vec<String> = filled.iter().map(|k| k.to_string()).collect();
    if let Some(m) = v.as_object() {
        for (k, x) in m {
            if !x.is_null() && !set(k) && !filled.contains(&k.as_str()) {
                defaults.push(k.clone());
            }
        }
    }
    (v, defaults)
}

/// Builds a tier from its spec. Implemented for plain closures
/// `Fn(&TierSpec, &BuildContext) -> Result<Arc<dyn SecondaryTier>>`.
#[async_trait]
pub trait TierBuilder: Send + Sync + 'static {
    /// Builds the tier; errors name fields relative to the tier entry (`root_dir`, ...).
    async fn build(&self, spec: &TierSpec, ctx: &BuildContext) -> Result<Arc<dyn SecondaryTier>>;

    /// Checks the tier's options without building it, and returns them as the tier will use
    /// them (defaults filled in), with the keys it filled. The default returns the options as
    /// written, unchecked, none filled.
    fn effective_options(&self, spec: &TierSpec) -> Result<(serde_json::Value, Vec<String>)> {
        Ok((serde_json::Value::Object(spec.options.clone()), Vec::new()))
    }
}

#[async_trait]
impl<F> TierBuilder for F
where
    F: Fn(&TierSpec, &BuildContext) -> Result<Arc<dyn SecondaryTier>> + Send + Sync + 'static,
{
    async fn build(&self, spec: &TierSpec, ctx: &BuildContext) -> Result<Arc<dyn SecondaryTier>> {
        self(spec, ctx)
    }
}

/// How [`TierRegistry::register_tier`] makes a tier from its parsed options, its name, the
/// namespace and the block size, on the manager's runtime.
pub enum Opener<C, T> {
    /// Blocking work (directories, files, a capability probe): run on the runtime's
    /// blocking pool (see [`BuildContext::open_blocking`]).
    Blocking(fn(String, C, Namespace, usize) -> Result<T>),
    /// A connection whose client lives on the manager's runtime (see
    /// [`BuildContext::connect_on_runtime`]).
    Connect(fn(String, C, Namespace, usize) -> futures::future::BoxFuture<'static, Result<T>>),
}

impl<C, T> fmt::Debug for Opener<C, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Opener::Blocking(_) => "Opener::Blocking",
            Opener::Connect(_) => "Opener::Connect",
        })
    }
}

/// The builder [`TierRegistry::register_tier`] registers.
struct Typed<C, T> {
    parse: fn(&TierSpec) -> Result<C>,
    open: Opener<C, T>,
}

#[async_trait]
impl<C, T> TierBuilder for Typed<C, T>
where
    C: EffectiveOptions + Send + 'static,
    T: SecondaryTier + 'static,
{
    fn effective_options(&self, spec: &TierSpec) -> Result<(serde_json::Value, Vec<String>)> {
        Ok(effective_of(&(self.parse)(spec)?, &spec.options))
    }

    async fn build(&self, spec: &TierSpec, ctx: &BuildContext) -> Result<Arc<dyn SecondaryTier>> {
        let cfg = (self.parse)(spec)?;
        let ns = ctx.require_namespace()?.clone();
        let (name, bs) = (ctx.name.clone(), ctx.block_size);
        let tier = match &self.open {
            Opener::Blocking(open) => {
                let open = *open;
                ctx.open_blocking(move || open(name, cfg, ns, bs)).await?
            }
            Opener::Connect(connect) => ctx.connect_on_runtime(connect(name, cfg, ns, bs)).await?,
        };
        Ok(Arc::new(tier))
    }
}

/// Maps type names to builders.
///
/// ```
/// use std::sync::Arc;
/// use kv_tier_core::{registry::TierRegistry, SecondaryTier};
/// let mut reg = TierRegistry::new();
/// let builder = |_spec: &kv_tier_core::config::TierSpec, _ctx: &kv_tier_core::registry::BuildContext|
///     -> kv_tier_core::Result<Arc<dyn SecondaryTier>> {
///     Err(kv_tier_core::Error::config("root", "example builder")) };
/// reg.register("mine", builder)?;
/// assert!(reg.contains("mine"));
/// // a type registers once (as in vLLM's tier factory): a second registration is an error
/// let err = reg.register("mine", builder).unwrap_err();
/// assert!(err.to_string().contains("\"mine\" is already registered"), "{err}");
/// # Ok::<(), kv_tier_core::Error>(())
/// ```
#[derive(Clone, Default)]
pub struct TierRegistry {
    builders: BTreeMap<String, Arc<dyn TierBuilder>>,
}

impl TierRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers the builder of `type_name`. A type registers once: a name already
    /// registered is an error (vLLM's tier factory raises too), never a silent replacement;
    /// [`TierRegistry::unregister`] first to replace one on purpose.
    pub fn register(
        &mut self,
        type_name: impl Into<String>,
        builder: impl TierBuilder,
    ) -> Result<&mut Self> {
        let type_name = type_name.into();
        if type_name.is_empty() {
            return Err(Error::config("type", "a tier type name must not be empty"));
        }
        if self.builders.contains_key(&type_name) {
            return Err(Error::config(
                "type",
                format!("tier type {type_name:?} is already registered"),
            ));
        }
        self.builders.insert(type_name, Arc::new(builder));
        Ok(self)
    }

    /// Removes the builder of `type_name`; whether it was registered.
    pub fn unregister(&mut self, type_name: &str) -> bool {
        self.builders.remove(type_name).is_some()
    }

    /// Registers `type_name` for a persistent tier (one that needs the namespace): its
    /// options are parsed and validated by `parse` (errors name their field; the options say
    /// what they fill in by default, [`EffectiveOptions`], for
    /// [`TierRegistry::effective_options`]), then `open` makes it. A tier crate registers itself in one call (the fs tier:
    /// `registry.register_tier("fs", FsTierConfig::from_spec, Opener::Blocking(..))`):
    ///
    /// ```
    /// use kv_tier_core::registry::{Opener, TierRegistry};
    /// use kv_tier_core::{Namespace, Result, SecondaryTier, config::TierSpec};
    ///
    /// #[derive(serde::Serialize)]
    /// struct MyOptions;
    /// impl kv_tier_core::registry::EffectiveOptions for MyOptions {}
    /// fn register<T: SecondaryTier>(
    ///     reg: &mut TierRegistry,
    ///     parse: fn(&TierSpec) -> Result<MyOptions>,
    ///     open: fn(String, MyOptions, Namespace, usize) -> Result<T>,
    /// ) {
    ///     reg.register_tier("mine", parse, Opener::Blocking(open)).unwrap();
    ///     assert!(reg.contains("mine"));
    /// }
    /// ```
    pub fn register_tier<C, T>(
        &mut self,
        type_name: impl Into<String>,
        parse: fn(&TierSpec) -> Result<C>,
        open: Opener<C, T>,
    ) -> Result<&mut Self>
    where
        C: EffectiveOptions + Send + 'static,
        T: SecondaryTier + 'static,
    {
        self.register(type_name, Typed { parse, open })
    }

    /// Checks the options of `spec` (the `index`-th entry of `secondary_tiers`) without
    /// building the tier, and returns them as the tier will use them, defaults filled in,
    /// with the keys filled (see [`TierBuilder::effective_options`]); errors name the field
    /// under `secondary_tiers[index]`.
    pub fn effective_options(
        &self,
        index: usize,
        spec: &TierSpec,
    ) -> Result<(serde_json::Value, Vec<String>)> {
        let prefix = format!("secondary_tiers[{index}]");
        self.builder(&prefix, spec)?
            .effective_options(spec)
            .map_err(|e| e.within(&prefix))
    }

    fn builder(&self, prefix: &str, spec: &TierSpec) -> Result<&Arc<dyn TierBuilder>> {
        self.builders.get(&spec.kind).ok_or_else(|| {
            if let Some(module) = &spec.module_path {
                // vLLM imports an out-of-tree tier class from `module_path`; here tiers are
                // Rust types registered at compile time
                return Error::config(
                    format!("{prefix}.module_path"),
                    format!(
                        "tier type {:?} from module {module:?}: kv-tier does not load tiers from Python modules; a tier is a Rust type registered at compile time (TierRegistry::register), before the manager is built. Registered types: {}",
                        spec.kind,
                        self.registered_list()
                    ),
                );
            }
            Error::config(
                format!("{prefix}.type"),
                format!(
                    "unknown tier type {:?}; registered types: {}",
                    spec.kind,
                    self.registered_list()
                ),
            )
        })
    }

    /// The registered type names for an error message (`none` when empty).
    fn registered_list(&self) -> String {
        if self.builders.is_empty() {
            "none".to_string()
        } else {
            self.type_names().join(", ")
        }
    }

    /// Whether `type_name` is registered.
    pub fn contains(&self, type_name: &str) -> bool {
        self.builders.contains_key(type_name)
    }

    /// The registered type names, sorted.
    pub fn type_names(&self) -> Vec<String> {
        self.builders.keys().cloned().collect()
    }

    /// Builds the tier of `spec` (the `index`-th entry of `secondary_tiers`); errors name the
    /// field under `secondary_tiers[index]`.
    pub async fn build(
        &self,
        index: usize,
        spec: &TierSpec,
        ctx: &BuildContext,
    ) -> Result<Arc<dyn SecondaryTier>> {
        let prefix = format!("secondary_tiers[{index}]");
        self.builder(&prefix, spec)?
            .build(spec, ctx)
            .await
            .map_err(|e| e.within(&prefix))
    }
}

impl fmt::Debug for TierRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TierRegistry")
            .field("types", &self.type_names())
            .finish()
    }
}
