//! The table `kubectl gpu top` prints (pure): per node and GPU, what is
//! granted and used, then each share on it. A figure nobody reported is
//! `-`; why a node's usage is unknown follows the table.

use super::UsageUnknown;
use super::scrape::Used;
use crate::rules::matching::Granted;

/// One node as `top` shows it.
#[derive(Debug, Clone)]
pub(crate) struct NodeView {
    pub(crate) name: String,
    /// Its GPUs (UUID, memory MiB), from its Node's inventory.
    pub(crate) gpus: Vec<(String, u64)>,
    /// The grants of the pods shown on it.
    pub(crate) grants: Vec<Granted>,
    /// What its daemon reports used, or why it could not be read.
    pub(crate) used: Result<Used, UsageUnknown>,
}

const HEADER: [&str; 7] = [
    "NODE",
    "GPU",
    "SHARE",
    "MEMORY GRANTED/USED",
    "CAPACITY",
    "CORE GRANTED",
    "SM USED",
];

pub(crate) fn render(nodes: &[NodeView]) -> String {
    let mut rows: Vec<[String; 7]> = vec![HEADER.map(str::to_owned)];
    let mut notes = Vec::new();
    for node in nodes {
        let used = node.used.as_ref().ok();
        if let Err(why) = &node.used {
            notes.push(format!("{}: usage unknown: {why}", node.name));
        }
        for (uuid, memory_mib) in &node.gpus {
            let shares: Vec<&Granted> = node.grants.iter().filter(|g| g.gpu == *uuid).collect();
            let key = |g: &Granted| {
                let pod = &g.pod;
                (
                    pod.namespace.clone(),
                    pod.name.clone(),
                    g.container.clone(),
                    uuid.clone(),
                )
            };
            let granted_mib: u64 = shares.iter().map(|g| g.memory_mib).sum();
            let core: u64 = shares.iter().map(|g| g.core_percent).sum();
            let gpu_used = used.and_then(|u| u.gpu_memory.get(uuid).copied());
            // Known once one share's is.
            let sm = used.and_then(|u| {
                let known = shares.iter().filter_map(|g| u.sm.get(&key(g)).copied());
                known.reduce(|a, b| a + b)
            });
            rows.push([
                node.name.clone(),
                uuid.clone(),
                match shares.len() {
                    1 => "1 share".to_owned(),
                    n => format!("{n} shares"),
                },
                format!("{}/{}", mib(granted_mib), bytes(gpu_used)),
                mib(*memory_mib),
                format!("{core}%"),
                percent(sm),
            ]);
            for g in shares {
                let k = key(g);
                rows.push([
                    String::new(),
                    String::new(),
                    format!("{}/{}/{}", k.0, k.1, k.2),
                    format!(
                        "{}/{}",
                        mib(g.memory_mib),
                        bytes(used.and_then(|u| u.memory.get(&k).copied()))
                    ),
                    String::new(),
                    format!("{}%", g.core_percent),
                    percent(used.and_then(|u| u.sm.get(&k).copied())),
                ]);
            }
        }
    }
    let widths: Vec<usize> = (0..HEADER.len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in &rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    for note in notes {
        out.push_str(&note);
        out.push('\n');
    }
    out
}

fn mib(m: u64) -> String {
    gib_or_mib(m as f64 * 1024.0 * 1024.0)
}

fn bytes(b: Option<f64>) -> String {
    b.map_or_else(|| "-".to_owned(), gib_or_mib)
}

fn gib_or_mib(b: f64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if b >= 1024.0 * MIB {
        format!("{:.1}Gi", b / (1024.0 * MIB))
    } else {
        format!("{:.0}Mi", b / MIB)
    }
}

fn percent(r: Option<f64>) -> String {
    r.map_or_else(|| "-".to_owned(), |r| format!("{:.0}%", r * 100.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::matching::pods::PodKey;
    use std::collections::HashMap;

    fn grant(pod: &str, container: &str, gpu: &str, memory_mib: u64, core_percent: u64) -> Granted {
        Granted {
            pod: PodKey {
                namespace: "ml".into(),
                name: pod.into(),
            },
            container: container.into(),
            gpu: gpu.into(),
            memory_mib,
            core_percent,
            whole: core_percent == 100,
        }
    }

    #[test]
    fn gpus_then_their_shares_with_what_each_uses() {
        let share = |pod: &str| {
            (
                "ml".to_owned(),
                pod.to_owned(),
                "c".to_owned(),
                "GPU-a".to_owned(),
            )
        };
        let used = Used {
            memory: HashMap::from([(share("p"), 1073741824.0)]),
            sm: HashMap::from([(share("p"), 0.4)]),
            gpu_memory: HashMap::from([("GPU-a".into(), 1107296256.0)]),
        };
        let nodes = [
            NodeView {
                name: "node-0".into(),
                gpus: vec![("GPU-a".into(), 16384), ("GPU-b".into(), 16384)],
                grants: vec![
                    grant("p", "c", "GPU-a", 4096, 30),
                    grant("q", "c", "GPU-a", 512, 0),
                ],
                used: Ok(used),
            },
            NodeView {
                name: "node-1".into(),
                gpus: vec![("GPU-c".into(), 40960)],
                grants: vec![grant("w", "train", "GPU-c", 40960, 100)],
                used: Err(UsageUnknown::NoDaemon("gpu-device-plugin".into())),
            },
        ];
        let text = render(&nodes);
        let lines: Vec<Vec<&str>> = text
            .lines()
            .map(|l| {
                l.split("  ")
                    .map(str::trim)
                    .filter(|c| !c.is_empty())
                    .collect()
            })
            .collect();
        assert_eq!(lines[0], HEADER);
        assert_eq!(
            lines[1],
            [
                "node-0",
                "GPU-a",
                "2 shares",
                "4.5Gi/1.0Gi",
                "16.0Gi",
                "30%",
                "40%"
            ]
        );
        assert_eq!(lines[2], ["ml/p/c", "4.0Gi/1.0Gi", "30%", "40%"]);
        assert_eq!(lines[3], ["ml/q/c", "512Mi/-", "0%", "-"]);
        assert_eq!(
            lines[4],
            ["node-0", "GPU-b", "0 shares", "0Mi/-", "16.0Gi", "0%", "-"]
        );
        assert_eq!(
            lines[5],
            [
                "node-1", "GPU-c", "1 share", "40.0Gi/-", "40.0Gi", "100%", "-"
            ]
        );
        assert_eq!(lines[6], ["ml/w/train", "40.0Gi/-", "100%", "-"]);
        assert_eq!(
            text.lines().last(),
            Some("node-1: usage unknown: no running daemon pod in namespace gpu-device-plugin")
        );
    }
}
