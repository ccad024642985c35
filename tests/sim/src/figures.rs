//! How the benches and the figure tests print latencies: one line per
//! figure, percentiles of the sorted samples, never asserted.

use std::time::Duration;

/// The `p` quantile (0..=1) of `sorted`, the nearest sample.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Prints `name: n=… p50=… ms p99=… ms max=… ms` of `samples`.
pub fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{name}: n={} p50={:.2} ms p99={:.2} ms max={:.2} ms",
        samples.len(),
        ms(percentile(&samples, 0.5)),
        ms(percentile(&samples, 0.99)),
        ms(samples[samples.len() - 1]),
    );
}
