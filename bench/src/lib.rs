//! What the benchmarks in `examples/` share: settings from the environment and the CPU
//! time a process has used.

use std::process::Command;
use std::sync::OnceLock;

/// The environment variable `name` as a number, or `default` when unset or not a number.
pub fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// User plus system CPU time of process `pid` so far, in seconds (0 if unreadable), from
/// `/proc/<pid>/stat`: the figure that stays steady on a machine shared with other work.
pub fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<u64>().ok())
        .sum();
    ticks as f64 / clock_ticks_per_second()
}

fn clock_ticks_per_second() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// `used_cpu_user + used_cpu_sys` of a Redis server, in seconds, from the text of its
/// `INFO cpu` (0 for a field it lacks).
pub fn redis_cpu_seconds(info: &str) -> f64 {
    info_field(info, "used_cpu_user") + info_field(info, "used_cpu_sys")
}

/// The number in field `name` of the text of a Redis `INFO` section (0 if it lacks it).
pub fn info_field(info: &str, name: &str) -> f64 {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
        .unwrap_or(0.0)
}
