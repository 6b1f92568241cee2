//! The algorithm explorer: replays a traffic pattern through every rate-limiting algorithm
//! (or the rules you name) and writes an SVG chart and a table.
//!
//! ```text
//! cargo run -p ratelimit-explore -- --pattern boundary --svg docs/explore-boundary.svg
//! cargo run -p ratelimit-explore -- --pattern steady --quota 10/s
//! cargo run -p ratelimit-explore -- --timestamps access.log --quota 100/min
//! cargo run -p ratelimit-explore -- --pattern domaintools \
//!     --rules "1/s sliding-log; 5/min sliding-log" --rules "5/min gcra burst=5"
//! cargo run -p ratelimit-explore -- --list
//! ```
//!
//! The measurements are defined in the `ratelimit_explore` crate docs.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use ratelimit_explore::{
    lanes_for_quota, Builtin, Exploration, ExploreError, Lane, LaneOptions, Pattern, Quota,
};

/// Replay a traffic pattern through every rate-limiting algorithm (or the rules you name)
/// on an in-memory store with a manual clock; print a table and write an SVG chart.
#[derive(Debug, Parser)]
#[command(name = "explore")]
struct Args {
    /// Built-in traffic pattern (see --list).
    #[arg(short, long, value_enum, default_value_t = Builtin::Boundary)]
    pattern: Builtin,

    /// Replay this file instead: one timestamp per line, seconds since the Unix epoch or
    /// RFC 3339. Needs --quota or --rules.
    #[arg(short = 'f', long, value_name = "FILE", conflicts_with = "pattern")]
    timestamps: Option<PathBuf>,

    /// The rate to compare at, e.g. 100/min: one rule per algorithm is built from it, and
    /// a built-in pattern is shaped around it. Default: the pattern's own.
    #[arg(short, long, value_name = "RATE")]
    quota: Option<Quota>,

    /// Compare these rules instead of one per algorithm, in the core's rule syntax; one
    /// row per use, e.g. --rules "1/s sliding-log; 5/min sliding-log".
    #[arg(short, long = "rules", value_name = "RULES")]
    rules: Vec<String>,

    /// Requests the token bucket, leaky buckets and GCRA take at once from idle.
    /// Default: the quota's limit (6 for the gcra pattern).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..), conflicts_with = "rules")]
    burst: Option<u64>,

    /// Sub-windows of the finer sliding window counter row.
    #[arg(long, value_name = "N", default_value_t = LaneOptions::default().precision,
          value_parser = clap::value_parser!(u64).range(1..), conflicts_with = "rules")]
    precision: u64,

    /// Where to write the chart. Default: explore-PATTERN.svg.
    #[arg(short = 'o', long = "svg", value_name = "PATH")]
    svg: Option<PathBuf>,

    /// List the built-in patterns and exit.
    #[arg(long)]
    list: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("explore: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    if args.list {
        for builtin in Builtin::ALL {
            let pattern = builtin.pattern(builtin.default_quota());
            println!("{:<15} {}", builtin.name(), pattern.description());
        }
        return Ok(());
    }

    let pattern = match &args.timestamps {
        Some(path) => {
            if args.quota.is_none() && args.rules.is_empty() {
                return Err(
                    "a timestamp file needs --quota (e.g. --quota 100/min) or --rules".into(),
                );
            }
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            let name = path
                .file_stem()
                .map_or_else(|| "timestamps".into(), |s| s.to_string_lossy());
            Pattern::from_timestamps(&name, &text)?
        }
        None => args
            .pattern
            .pattern(args.quota.unwrap_or(args.pattern.default_quota())),
    };

    let lanes = if !args.rules.is_empty() {
        args.rules
            .iter()
            .map(|r| Lane::parse(r))
            .collect::<Result<_, _>>()?
    } else if args.quota.is_none() && !args.pattern.default_rules().is_empty() {
        args.pattern
            .default_rules()
            .iter()
            .map(|r| Lane::parse(r))
            .collect::<Result<_, ExploreError>>()?
    } else {
        let quota = args.quota.unwrap_or(args.pattern.default_quota());
        let options = LaneOptions {
            burst: args.burst.or(args.pattern.default_options().burst),
            precision: args.precision,
        };
        let (lanes, skipped) = lanes_for_quota(quota, options);
        for note in skipped {
            eprintln!("explore: {note}");
        }
        lanes
    };
    if lanes.is_empty() {
        return Err("no rule could be built; try another --quota or name --rules".into());
    }

    let exploration = Exploration::run(pattern, lanes)?;
    print!("{}", exploration.table());
    let path = args
        .svg
        .unwrap_or_else(|| format!("explore-{}.svg", exploration.pattern().name()).into());
    std::fs::write(&path, exploration.svg()?)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    eprintln!("chart written to {}", path.display());
    Ok(())
}
