//! The explorer's numbers for the articles' worked scenarios, each derived by hand in the
//! comments, and the chart's shape.

use std::time::Duration;

use ratelimit_explore::{
    lanes_for_quota, most_in_any_window, Builtin, Exploration, ExploreError, Lane, LaneOptions,
    Pattern, Quota, Stats,
};

const S: u64 = 1_000_000;
const MS: u64 = 1_000;

fn builtin(pattern: Builtin) -> Exploration {
    let quota = pattern.default_quota();
    let (lanes, skipped) = lanes_for_quota(quota, pattern.default_options());
    assert!(skipped.is_empty(), "{skipped:?}");
    Exploration::run(pattern.pattern(quota), lanes).unwrap()
}

fn stats(run: &Exploration, label: &str) -> Stats {
    run.lane(label)
        .unwrap_or_else(|| panic!("no lane {label:?}"))
        .stats()
}

/// The table's cells for the row of `label`: columns are separated by two or more spaces.
fn table_row(run: &Exploration, label: &str) -> Vec<String> {
    let table = run.table();
    let line = table
        .lines()
        .find(|l| l.starts_with(&format!("{label}  ")))
        .unwrap_or_else(|| panic!("no row {label:?} in\n{table}"));
    line.split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Admitted requests offered exactly at `at_us`.
fn admitted_at(run: &Exploration, label: &str, at_us: u64) -> usize {
    run.lane(label)
        .unwrap()
        .verdicts()
        .iter()
        .filter(|v| v.at_us == at_us && v.admitted)
        .count()
}

#[test]
fn classdojo_sliding_window_counter_admits_25_at_a_quarter_into_the_next_window() {
    // 100/min; 100 requests in the first 15 s; 100 more at once at 75 s. Precision 1: the
    // previous window's 100 weigh 45/60, so 75 are counted and 25 admitted.
    let run = builtin(Builtin::Classdojo);
    assert_eq!(admitted_at(&run, "sliding window p=1", 75 * S), 25);
    assert_eq!(stats(&run, "sliding window p=1").admitted, 125);
    // Precision 2 (30 s sub-windows): at 75 s only the 0-30 s sub-window still counts,
    // weighted 15/30, so 50 are admitted.
    assert_eq!(admitted_at(&run, "sliding window p=2", 75 * S), 50);
    assert_eq!(stats(&run, "sliding window p=2").admitted, 150);
    // The exact log sees nothing in (15 s, 75 s] and admits all 100.
    assert_eq!(admitted_at(&run, "sliding log", 75 * S), 100);
    // A steady client resending at Retry-After: precision 1 admits 74 more of the burst
    // in the 60-120 s window as the first 100 weigh less, the last one at 120 s, 45 s
    // after it was offered.
    assert_eq!(
        stats(&run, "sliding window p=1").longest_wait,
        Some(Duration::from_secs(45))
    );

    assert_eq!(
        table_row(&run, "sliding window p=1"),
        [
            "sliding window p=1",
            "100/1m sliding-window precision=1",
            "125",
            "75",
            "100/1m",
            "45s"
        ]
    );
    assert_eq!(table_row(&run, "sliding window p=2")[2..4], ["150", "50"]);
}

#[test]
fn classdojo_late_burst_admits_75() {
    // At 105 s the previous window weighs 15/60: 25 counted, 75 admitted.
    let run = builtin(Builtin::ClassdojoLate);
    assert_eq!(admitted_at(&run, "sliding window p=1", 105 * S), 75);
    assert_eq!(stats(&run, "sliding window p=1").admitted, 175);
    assert_eq!(table_row(&run, "sliding window p=1")[2..4], ["175", "25"]);
}

#[test]
fn boundary_double_burst() {
    // 100/min; 100 requests at 55-60 s and 100 at 60-65 s, 50 ms apart.
    let run = builtin(Builtin::Boundary);

    // The fixed window admits all 200 within 10 seconds.
    let fixed = run.lane("fixed window").unwrap();
    assert_eq!(fixed.stats().admitted, 200);
    assert_eq!(fixed.stats().most_in_period, 200);
    assert_eq!(most_in_any_window(&fixed.passes_us(), 10 * S), 200);
    assert_eq!(fixed.stats().longest_wait, Some(Duration::ZERO));
    assert_eq!(
        table_row(&run, "fixed window")[2..],
        ["200", "0", "200/1m", "0s"]
    );

    // The sliding log admits the first 100 only, and the second burst waits until the
    // first one leaves the window: 60.00 s waits until 115.00 s, and so on.
    let log = stats(&run, "sliding log");
    assert_eq!(
        (log.admitted, log.denied, log.most_in_period),
        (100, 100, 100)
    );
    assert_eq!(log.longest_wait, Some(Duration::from_secs(55)));
    assert_eq!(
        table_row(&run, "sliding log")[2..],
        ["100", "100", "100/1m", "55s"]
    );

    // Precision 1 at 60 s + 50 ms × k: 100 × (60 - 0.05k)/60 + admitted + 1 <= 100, so
    // one in every 12 passes: k = 12, 24, ..., 96.
    assert_eq!(stats(&run, "sliding window p=1").admitted, 108);
    // Precision 2: the first burst sits wholly in the 30-60 s sub-window, counted in full.
    assert_eq!(stats(&run, "sliding window p=2").admitted, 100);

    // The buckets hold 100 and refill 1 per 0.6 s: 100 + 9.95 s × 100/60 = 116.58.
    for label in ["token bucket", "leaky bucket meter", "GCRA"] {
        let s = stats(&run, label);
        assert_eq!((s.admitted, s.most_in_period), (116, 116), "{label}");
        // The 200th token arrives at 55 + 60 s: the last request, offered at 64.95 s,
        // waits 50.05 s.
        assert_eq!(
            s.longest_wait,
            Some(Duration::from_millis(50_050)),
            "{label}"
        );
    }

    // The shaper admits as many, all but the first late, and releases them 0.6 s apart:
    // never more than 100 in a minute reach the service.
    let shaper = stats(&run, "leaky bucket shaper");
    assert_eq!((shaper.admitted, shaper.delayed), (116, 115));
    assert_eq!(shaper.most_in_period, 100);
    // A steady client's 200th request leaves at 55 + 199 × 0.6 = 174.4 s; offered at
    // 64.95 s, it waited 109.45 s, first for room in the queue, then in it.
    assert_eq!(shaper.longest_wait, Some(Duration::from_millis(109_450)));
    assert_eq!(
        table_row(&run, "leaky bucket shaper")[2..],
        ["116 (115 late)", "84", "100/1m", "1m 49.45s"]
    );
}

#[test]
fn gcra_admits_six_at_once_then_one_every_10_ms() {
    // 100/s with a burst of 6: ten requests at 0, then one every 2 ms up to 198 ms.
    let run = builtin(Builtin::Gcra);
    let expected: Vec<u64> = [0; 5]
        .into_iter()
        .chain((0..20).map(|k| k * 10 * MS))
        .collect();
    for label in ["GCRA", "token bucket", "leaky bucket meter"] {
        assert_eq!(run.lane(label).unwrap().passes_us(), expected, "{label}");
        assert_eq!(table_row(&run, label)[2..4], ["25", "84"], "{label}");
    }
    // The shaper takes the same requests but releases them one per 10 ms from the start.
    let shaper = run.lane("leaky bucket shaper").unwrap();
    let smoothed: Vec<u64> = (0..25).map(|k| k * 10 * MS).collect();
    assert_eq!(shaper.passes_us(), smoothed);
    assert_eq!(shaper.stats().delayed, 24);
    // The window algorithms see 109 requests in 0.2 s and admit the first 100.
    assert_eq!(stats(&run, "fixed window").admitted, 100);
    assert_eq!(stats(&run, "sliding log").admitted, 100);
}

#[test]
fn domaintools_log_waits_four_seconds() {
    // "1/s; 5/min" on one log. At 12:34:31 the fifth newest entry (12:33:35) is only 56 s
    // old: denied, come back in 4 s. At 12:34:40 both rules pass.
    let lanes = Builtin::Domaintools
        .default_rules()
        .iter()
        .map(|r| Lane::parse(r))
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let run = Exploration::run(
        Builtin::Domaintools.pattern(Builtin::Domaintools.default_quota()),
        lanes,
    )
    .unwrap();
    let log = run.lane("sliding log").unwrap();
    assert_eq!(
        log.lane().rules().to_string(),
        "1/1s sliding-log; 5/1m sliding-log"
    );
    let denied: Vec<u64> = log
        .verdicts()
        .iter()
        .filter(|v| !v.admitted)
        .map(|v| v.at_us)
        .collect();
    let t_12_33_00 = (12 * 3600 + 33 * 60) * S;
    assert_eq!(denied, [t_12_33_00 + 91 * S]);
    assert_eq!(log.stats().longest_wait, Some(Duration::from_secs(4)));
    assert_eq!(log.stats().most_in_period, 5);
    assert_eq!(
        table_row(&run, "sliding log")[1..],
        ["1/1s sliding-log; 5/1m sliding-log", "6", "1", "5/1m", "4s"]
    );
    // Fixed windows: 12:34:31 is only the fourth request of the 12:34 window.
    assert_eq!(table_row(&run, "fixed window")[2..4], ["7", "0"]);
}

#[test]
fn idle_then_burst_buckets_admit_the_whole_burst() {
    // 100/min: 100 requests over the first minute, idle 30 s, 100 in 3 s from 90 s.
    let run = builtin(Builtin::IdleBurst);
    // The token bucket refilled while idle and admits the whole burst: with the 45 steady
    // requests from 33 s on, 145 pass in one minute.
    let bucket = stats(&run, "token bucket");
    assert_eq!((bucket.admitted, bucket.most_in_period), (200, 145));
    // The log still holds the steady requests after 30 s: 49 of them at 90 s, 45 at
    // 92.97 s, so 55 of the burst pass.
    let log = stats(&run, "sliding log");
    assert_eq!((log.admitted, log.most_in_period), (155, 100));
}

#[test]
fn steady_over_limit() {
    // 200/min offered for three minutes at 100/min.
    let run = builtin(Builtin::Steady);
    // Windows and the log admit the first 100 of each minute, 0.3 s apart: 30 s on, 30 off.
    for label in ["fixed window", "sliding log"] {
        let s = stats(&run, label);
        assert_eq!((s.admitted, s.denied, s.most_in_period), (300, 300, 100));
    }
    // The bucket: 100 at first, then 1 per 0.6 s; 100 + 179.7 × 100/60 = 399.5.
    let bucket = stats(&run, "token bucket");
    assert_eq!((bucket.admitted, bucket.most_in_period), (399, 199));
}

#[test]
fn svg_is_well_formed_with_one_row_per_lane() {
    let run = builtin(Builtin::Boundary);
    let svg = run.svg().unwrap();
    let doc = roxmltree::Document::parse(&svg).expect("the chart is well-formed XML");
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    let height: u32 = root.attribute("height").unwrap().parse().unwrap();
    assert!(height >= 100 * run.lanes().len() as u32);

    let texts: Vec<String> = root
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| n.text().unwrap_or_default().trim().to_owned())
        .collect();
    assert!(texts
        .iter()
        .any(|t| t.starts_with("boundary: 200 requests offered")));
    let captions: Vec<&String> = texts
        .iter()
        .filter(|t| t.contains("): admitted "))
        .collect();
    assert_eq!(captions.len(), 8, "{captions:?}");
    for (caption, lane) in captions.iter().zip(run.lanes()) {
        let s = lane.stats();
        assert_eq!(
            **caption,
            format!(
                "{} ({}): admitted {} of 200, at most {} in any 1m",
                lane.lane().label(),
                lane.lane().rules(),
                s.admitted,
                s.most_in_period
            )
        );
    }
    // The time axis runs from 30 s past the window boundary at 60 s to 120 s and beyond.
    for tick in ["30", "60", "120"] {
        assert!(texts.iter().any(|t| t == tick), "no tick {tick}");
    }
    // Bars are drawn: at least one per lane for the admitted requests.
    let rects = root
        .descendants()
        .filter(|n| n.has_tag_name("rect"))
        .count();
    assert!(rects > 8 * 10, "{rects} rects");
}

#[test]
fn timestamp_files_replay_like_the_builtin_timeline() {
    // The DomainTools timeline as an access log: RFC 3339 with offsets, epoch seconds,
    // comments, blank lines, out of order.
    let log = "\
# the DomainTools example, on 2024-01-01
2024-01-01T12:33:35Z
2024-01-01T13:33:37+01:00

1704112454
1704112466.000
2024-01-01T12:34:40.000000Z
2024-01-01T12:34:28Z
1704112471
";
    let pattern = Pattern::from_timestamps("access", log).unwrap();
    let base = 1_704_112_380 * S; // 2024-01-01T12:33:00Z
    let offsets: Vec<u64> = pattern.times_us().iter().map(|t| (t - base) / S).collect();
    assert_eq!(offsets, [35, 37, 74, 86, 88, 91, 100]);

    let lanes = vec![Lane::parse("1/s sliding-log; 5/min sliding-log").unwrap()];
    let run = Exploration::run(pattern, lanes).unwrap();
    let s = stats(&run, "sliding log");
    assert_eq!((s.admitted, s.denied), (6, 1));
    assert_eq!(s.longest_wait, Some(Duration::from_secs(4)));
}

#[test]
fn timestamp_errors_name_the_line() {
    let err = Pattern::from_timestamps("bad", "1700000000\n\nyesterday\n").unwrap_err();
    assert!(
        matches!(err, ExploreError::Timestamp { line: 3, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("RFC 3339"), "{err}");
    assert!(matches!(
        Pattern::from_timestamps("neg", "-5").unwrap_err(),
        ExploreError::Timestamp { line: 1, .. }
    ));
    assert!(matches!(
        Pattern::from_timestamps("empty", "# nothing\n\n").unwrap_err(),
        ExploreError::NoTimestamps
    ));
    // Fractions are kept to the microsecond.
    let p = Pattern::from_timestamps("frac", "1700000000.123456\n").unwrap();
    assert_eq!(p.times_us(), [1_700_000_000_123_456]);
}

#[test]
fn quota_lanes_leave_out_what_the_core_cannot_build() {
    let quota: Quota = "20000/h".parse().unwrap();
    let (lanes, skipped) = lanes_for_quota(quota, LaneOptions::default());
    assert!(lanes.iter().all(|l| l.label() != "sliding log"));
    assert_eq!(lanes.len(), 7);
    assert_eq!(skipped.len(), 1);
    assert!(
        skipped[0].starts_with("sliding log left out"),
        "{skipped:?}"
    );

    // 60 s is not divisible into 7 whole-microsecond sub-windows.
    let quota: Quota = "100/min".parse().unwrap();
    let options = LaneOptions {
        precision: 7,
        ..LaneOptions::default()
    };
    let (_, skipped) = lanes_for_quota(quota, options);
    assert!(
        skipped[0].starts_with("sliding window p=7 left out"),
        "{skipped:?}"
    );

    assert!(matches!(
        "100/fortnight".parse::<Quota>(),
        Err(ExploreError::Quota { .. })
    ));
    assert_eq!(quota.to_string(), "100/1m");
    assert!(matches!(
        Lane::parse("1/s sliding-log; oops"),
        Err(ExploreError::Rules { .. })
    ));
}

#[test]
fn most_in_any_window_is_half_open() {
    assert_eq!(most_in_any_window(&[], 10), 0);
    assert_eq!(most_in_any_window(&[0, 10, 20], 10), 1);
    assert_eq!(most_in_any_window(&[0, 10, 20], 11), 2);
    assert_eq!(most_in_any_window(&[5, 5, 5, 30], 1), 3);
}

#[test]
fn checked_in_chart_and_readme_table_are_current() {
    let run = builtin(Builtin::Boundary);
    let regenerate = "regenerate with `cargo run -p ratelimit-explore -- \
                      --pattern boundary --svg docs/explore-boundary.svg` and paste the table \
                      into README.md";
    let chart = include_str!("../../docs/explore-boundary.svg");
    assert!(
        chart == run.svg().unwrap(),
        "docs/explore-boundary.svg is stale: {regenerate}"
    );
    let readme = include_str!("../../README.md");
    let table = run.table();
    let rows: Vec<&str> = table
        .lines()
        .skip_while(|l| !l.starts_with("algorithm "))
        .take_while(|l| !l.is_empty())
        .collect();
    assert_eq!(rows.len(), 9);
    let block = rows.join("\n");
    assert!(
        readme.contains(&block),
        "README.md's table is stale: {regenerate}"
    );
}
