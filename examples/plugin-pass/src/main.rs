//! graphtrain's command line with `silu-expand` registered next to the built-in passes: every
//! command works as in `graphtrain`, and `passes list/explain/apply` also know the plugin.

fn main() -> std::process::ExitCode {
    graphtrain::cli::main_with(std::env::args_os(), plugin_pass::registry())
}
