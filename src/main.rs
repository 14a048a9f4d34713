fn main() -> std::process::ExitCode {
    graphtrain::cli::main(std::env::args_os())
}
