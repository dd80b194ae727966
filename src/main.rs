//! The `confed` binary: its commands are in `cli/`, one module each.

mod cli;

fn main() -> std::process::ExitCode {
    match cli::run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            // One readable line (with its causes), not a backtrace: this is what operators see.
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
