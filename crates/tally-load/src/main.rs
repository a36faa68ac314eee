//! `tally-load`: drives a Tally node or fleet (loopback only unless `--allow-remote`) and
//! verifies exactly-once application of every idempotency key it sent.
//!
//! Exit status: 0 when the verdict passes (or verification is off), 1 when it fails or could
//! not complete, 2 on bad options or a failed setup.

use std::process::ExitCode;

use clap::Parser;

/// Exit status for a failed or incomplete exactly-once verdict.
const EXIT_VERDICT_FAILED: u8 = 1;
/// Exit status for bad options or a run that could not produce a report.
const EXIT_ERROR: u8 = 2;

#[tokio::main]
async fn main() -> ExitCode {
    let options = tally_load::Options::parse();
    let json = options.json;
    let report = match tally_load::run(options).await {
        Ok(report) => report,
        Err(e) => {
            eprintln!("tally-load: {e}");
            return ExitCode::from(EXIT_ERROR);
        }
    };
    let text = if json {
        match serde_json::to_string(&report) {
            Ok(text) => format!("{text}\n"),
            Err(e) => {
                eprintln!("tally-load: cannot encode report: {e}");
                return ExitCode::from(EXIT_ERROR);
            }
        }
    } else {
        report.to_string()
    };
    // A reader that went away (`tally-load ... | head`) is no failure of the run.
    if let Err(e) = std::io::Write::write_all(&mut std::io::stdout().lock(), text.as_bytes())
        && e.kind() != std::io::ErrorKind::BrokenPipe
    {
        eprintln!("tally-load: cannot write the report: {e}");
        return ExitCode::from(EXIT_ERROR);
    }
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_VERDICT_FAILED)
    }
}
