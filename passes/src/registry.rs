//! Passes by name. Built-in passes are registered by `Registry::builtin`; plugins add their own
//! with `Registry::register` before building a pipeline.

use crate::pass::{Pass, Tier};
use std::collections::BTreeMap;

/// What `graphtrain passes list` and `passes explain` show for a pass.
#[derive(Clone, Debug)]
pub struct PassInfo {
    pub name: &'static str,
    pub tier: Tier,
    /// One line for `passes list`.
    pub summary: &'static str,
    /// The pass contract for `passes explain`: what it changes, what it guarantees, when it
    /// declines and why.
    pub contract: &'static str,
    /// The accepted `name=OPTION` values, or `None` when the pass takes no option.
    pub option_help: Option<&'static str>,
}

/// Builds a pass from its optional `name=OPTION` argument, or says what is wrong with it.
pub type PassBuilder = Box<dyn Fn(Option<&str>) -> Result<Box<dyn Pass>, String> + Send + Sync>;

struct Entry {
    info: PassInfo,
    build: PassBuilder,
}

#[derive(Default)]
pub struct Registry {
    entries: BTreeMap<&'static str, Entry>,
}

impl Registry {
    /// An empty registry (plugins that want full control start here).
    pub fn empty() -> Self {
        Registry::default()
    }

    /// Every pass that ships with graphtrain.
    pub fn builtin() -> Self {
        let mut r = Registry::empty();
        crate::register_builtin(&mut r);
        r
    }

    /// Adds a pass; a name registered twice is a programming error and panics at startup.
    pub fn register(
        &mut self,
        info: PassInfo,
        build: impl Fn(Option<&str>) -> Result<Box<dyn Pass>, String> + Send + Sync + 'static,
    ) {
        let name = info.name;
        let previous = self.entries.insert(
            name,
            Entry {
                info,
                build: Box::new(build),
            },
        );
        assert!(previous.is_none(), "pass `{name}` registered twice");
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.entries.keys().copied().collect()
    }

    pub fn info(&self, name: &str) -> Option<&PassInfo> {
        self.entries.get(name).map(|e| &e.info)
    }

    pub fn infos(&self) -> impl Iterator<Item = &PassInfo> {
        self.entries.values().map(|e| &e.info)
    }

    fn unknown(&self, name: &str) -> String {
        format!(
            "unknown pass `{name}`; known passes: {}",
            self.names().join(", ")
        )
    }

    /// Builds pass `name` with `option` (the part after `=`).
    pub fn build(&self, name: &str, option: Option<&str>) -> Result<Box<dyn Pass>, String> {
        let entry = self.entries.get(name).ok_or_else(|| self.unknown(name))?;
        if option.is_some() && entry.info.option_help.is_none() {
            return Err(format!(
                "pass `{name}` takes no option, got `{name}={}`",
                option.unwrap_or_default()
            ));
        }
        (entry.build)(option).map_err(|e| {
            let help = entry
                .info
                .option_help
                .map(|h| format!(" (accepted: {h})"))
                .unwrap_or_default();
            format!("pass `{name}`: {e}{help}")
        })
    }

    /// Checks that `name` is registered.
    pub fn require(&self, name: &str) -> Result<(), String> {
        if self.entries.contains_key(name) {
            Ok(())
        } else {
            Err(self.unknown(name))
        }
    }
}
