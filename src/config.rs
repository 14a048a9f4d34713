//! Resolving `--model` / `--config` into a model configuration: a built-in name, a RON file, or
//! a Hugging Face Llama `config.json` (`hf.rs`).

use graphtrain_models::{Llama3Config, LLAMA3_CONFIGS, MODELS};
use std::path::Path;

/// Looks up `--model`.
pub fn check_model(model: &str) -> Result<(), String> {
    if MODELS.contains(&model) {
        Ok(())
    } else {
        Err(format!(
            "unknown model `{model}`; known models: {}",
            MODELS.join(", ")
        ))
    }
}

/// A built-in config name, a path to a RON file holding every `Llama3Config` field, or a
/// transformers Llama `config.json` (or the model folder holding one).
pub fn load_config(spec: &str) -> Result<Llama3Config, String> {
    if let Some(cfg) = Llama3Config::builtin(spec) {
        return Ok(cfg);
    }
    let path = Path::new(spec);
    if let Some(json) = hf_config_path(spec) {
        let text = std::fs::read_to_string(&json)
            .map_err(|e| format!("cannot read config file `{}`: {e}", json.display()))?;
        return crate::hf::config_from_hf(&text).map_err(|e| {
            format!(
                "config file `{}` (a transformers config): {e}",
                json.display()
            )
        });
    }
    let looks_like_path = spec.contains('/') || spec.ends_with(".ron") || path.exists();
    if !looks_like_path {
        return Err(format!(
            "unknown config `{spec}`; built-in configs: {}; or give a path to a RON file \
             (start from `graphtrain config show tiny`)",
            LLAMA3_CONFIGS.join(", ")
        ));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read config file `{spec}`: {e}"))?;
    parse_config(&text).map_err(|e| format!("config file `{spec}`: {e}"))
}

/// The transformers `config.json` that `spec` names: itself where it ends in `.json`, or the
/// one in the folder it names; `None` for anything else (a built-in name, a RON file).
pub fn hf_config_path(spec: &str) -> Option<std::path::PathBuf> {
    let path = Path::new(spec);
    if path.is_dir() {
        Some(path.join("config.json"))
    } else {
        spec.ends_with(".json").then(|| path.to_path_buf())
    }
}

/// Parses a RON config; errors carry the line:column ron reports and the field at fault.
pub fn parse_config(text: &str) -> Result<Llama3Config, String> {
    let cfg: Llama3Config = ron::from_str(text).map_err(|e| e.to_string())?;
    cfg.validate()?;
    Ok(cfg)
}

/// A config as pretty RON, the format `load_config` reads back.
pub fn config_to_ron(cfg: &Llama3Config) -> String {
    ron::ser::to_string_pretty(cfg, ron::ser::PrettyConfig::default())
        .expect("a config always serializes")
}
