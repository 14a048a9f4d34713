//! Graphs as RON, the serde format the rest of the project uses for configs and dumps.
//!
//! Unlike the text format, RON keeps a graph exactly as it is in memory (value numbering
//! included) and needs no hand-written parser, so it is the format for caching and exchanging
//! graphs between tools; the text format is for people.

use crate::graph::Graph;

/// `g` as pretty-printed RON.
pub fn to_ron(g: &Graph) -> String {
    ron::ser::to_string_pretty(g, ron::ser::PrettyConfig::default())
        .expect("a graph holds only plain data, which RON can always serialize")
}

/// Reads a graph written by [`to_ron`]; the error says where the text went wrong.
pub fn from_ron(s: &str) -> Result<Graph, String> {
    ron::from_str(s).map_err(|e| format!("invalid graph RON at {e}"))
}
