//! What a daemon's `/metrics` says is used (pure): the few series `top`
//! shows, read from the daemon's own exposition (OpenMetrics text as
//! prometheus-client writes it: `name{label="value",…} number`, with `\\`,
//! `\"` and `\n` escaped in values). A line that does not parse is
//! skipped, never guessed at; the caller reads at most
//! [`super::METRICS_LIMIT`] of it.

use std::collections::HashMap;

/// One container on one GPU: namespace, pod, container, GPU UUID.
pub(crate) type Share = (String, String, String, String);

/// What the daemon reports used.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Used {
    /// Per share: its device memory, bytes.
    pub(crate) memory: HashMap<Share, f64>,
    /// Per share: its share of the GPU's SMs (a ratio).
    pub(crate) sm: HashMap<Share, f64>,
    /// Per GPU: the memory of all its compute processes, bytes.
    pub(crate) gpu_memory: HashMap<String, f64>,
}

const PREFIX: &str = "gpu_device_plugin_";

pub(crate) fn parse(text: &str) -> Used {
    let mut used = Used::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, labels, value)) = sample(line) else {
            continue;
        };
        let label = |k: &str| labels.get(k).cloned().unwrap_or_default();
        let share = || {
            let (ns, pod) = (label("namespace"), label("pod"));
            (ns, pod, label("container"), label("gpu"))
        };
        match name.strip_prefix(PREFIX) {
            Some("container_memory_used_bytes") => {
                used.memory.insert(share(), value);
            }
            Some("container_sm_utilization_ratio") => {
                used.sm.insert(share(), value);
            }
            Some("gpu_memory_used_bytes") => {
                used.gpu_memory.insert(label("gpu"), value);
            }
            _ => {}
        }
    }
    used
}

/// A sample line's name, labels and value.
fn sample(line: &str) -> Option<(&str, HashMap<String, String>, f64)> {
    let end = line.find(['{', ' '])?;
    let name = &line[..end];
    let mut labels = HashMap::new();
    let mut rest = &line[end..];
    if let Some(mut inner) = rest.strip_prefix('{') {
        loop {
            inner = inner.strip_prefix(',').unwrap_or(inner);
            if let Some(after) = inner.strip_prefix('}') {
                rest = after;
                break;
            }
            let (key, after) = inner.split_once("=\"")?;
            let (value, after) = quoted(after)?;
            labels.insert(key.to_owned(), value);
            inner = after;
        }
    }
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some((name, labels, value))
}

/// A label value up to its closing quote, unescaped, and what follows.
fn quoted(text: &str) -> Option<(String, &str)> {
    let mut value = String::new();
    let mut chars = text.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((value, &text[i + 1..])),
            '\\' => match chars.next()?.1 {
                'n' => value.push('\n'),
                other => value.push(other),
            },
            c => value.push(c),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_series_top_shows_are_read_and_the_rest_skipped() {
        let text = r#"# HELP gpu_device_plugin_container_memory_used_bytes Device memory.
# TYPE gpu_device_plugin_container_memory_used_bytes gauge
gpu_device_plugin_container_memory_used_bytes{namespace="ml",pod="p",container="c",gpu="GPU-a"} 1073741824
gpu_device_plugin_container_sm_utilization_ratio{namespace="ml",pod="p",container="c",gpu="GPU-a"} 0.4
gpu_device_plugin_container_sm_utilization_ratio{namespace="ml",pod="we\"ird\\",container="c",gpu="GPU-a"} 0.1
gpu_device_plugin_gpu_memory_used_bytes{gpu="GPU-a"} 2e9
gpu_device_plugin_build_info{version="0.1.0",git="abc"} 1
gpu_device_plugin_gpu_memory_used_bytes{gpu="GPU-b"} not-a-number
gpu_device_plugin_gpu_memory_used_bytes{gpu="GPU-c
# EOF
"#;
        let used = parse(text);
        let share = |pod: &str| ("ml".into(), pod.into(), "c".into(), "GPU-a".into());
        assert_eq!(used.memory, HashMap::from([(share("p"), 1073741824.0)]));
        assert_eq!(
            used.sm,
            HashMap::from([(share("p"), 0.4), (share("we\"ird\\"), 0.1)])
        );
        assert_eq!(used.gpu_memory, HashMap::from([("GPU-a".into(), 2e9)]));
    }
}
