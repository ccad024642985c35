//! The trace's files, read: the nodes of `openb_node_list_gpu_node.csv` and
//! the tasks of an `openb_pod_list_*.csv` (the folder's README names the
//! columns). A row that does not read stops the run with its line.

use std::path::Path;

/// The GPU models of the trace, with the memory each is taken to have:
/// the public sizes, and for G1–G3 (undisclosed internal codes) an
/// assumption the placement figures do not depend on, since every share
/// asks a fraction of its GPU's memory whatever its size.
pub const MODELS: &[(&str, u64)] = &[
    ("P100", 16),
    ("T4", 16),
    ("V100M16", 16),
    ("V100M32", 32),
    ("A10", 24),
    ("G1", 24),
    ("G2", 32),
    ("G3", 32),
];

#[derive(Debug, Clone)]
pub struct TraceNode {
    pub name: String,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub gpus: usize,
    /// Index in [`MODELS`].
    pub model: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Task {
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// 0: CPU only; 1: one GPU, all of it or `gpu_milli` of it; more:
    /// that many whole GPUs.
    pub num_gpu: u32,
    /// Thousandths of one GPU, for `num_gpu` 1.
    pub gpu_milli: u32,
    /// The models it may run on (bits of [`MODELS`]); 0: any.
    pub models: u32,
}

impl Task {
    /// What it asks of the cluster's GPUs, in thousandths of a GPU.
    pub fn gpu_demand(&self) -> u64 {
        match self.num_gpu {
            0 => 0,
            1 => u64::from(self.gpu_milli),
            n => 1000 * u64::from(n),
        }
    }

    /// A share of one GPU (not all of it).
    pub fn shared(&self) -> bool {
        self.num_gpu == 1 && self.gpu_milli < 1000
    }

    /// How many GPUs it takes whole.
    pub fn whole(&self) -> u32 {
        if self.shared() { 0 } else { self.num_gpu }
    }

    pub fn allows(&self, model: usize) -> bool {
        self.models == 0 || self.models & (1 << model) != 0
    }
}

fn model(name: &str) -> Result<usize, String> {
    MODELS
        .iter()
        .position(|(m, _)| *m == name)
        .ok_or_else(|| format!("unknown GPU model {name:?}"))
}

/// The columns of `text`'s header row, by name, and its data rows.
fn rows<'a>(text: &'a str, wanted: &[&str]) -> Result<Vec<(usize, Vec<&'a str>)>, String> {
    let mut lines = text.lines().enumerate();
    let (_, header) = lines.next().ok_or("empty file")?;
    let header: Vec<&str> = header.split(',').collect();
    let at: Vec<usize> = wanted
        .iter()
        .map(|w| {
            header
                .iter()
                .position(|h| h == w)
                .ok_or_else(|| format!("no column {w:?}"))
        })
        .collect::<Result<_, _>>()?;
    lines
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let fields: Vec<&str> = l.split(',').collect();
            let picked = at
                .iter()
                .map(|&a| {
                    fields
                        .get(a)
                        .copied()
                        .ok_or(format!("line {}: too few fields", i + 1))
                })
                .collect::<Result<_, _>>()?;
            Ok((i + 1, picked))
        })
        .collect()
}

fn number(line: usize, field: &str) -> Result<u64, String> {
    field
        .trim()
        .parse()
        .map_err(|e| format!("line {line}: {field:?}: {e}"))
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}

pub fn nodes(dir: &Path) -> Result<Vec<TraceNode>, String> {
    let path = dir.join("openb_node_list_gpu_node.csv");
    let text = read(&path)?;
    rows(&text, &["sn", "cpu_milli", "memory_mib", "gpu", "model"])?
        .into_iter()
        .map(|(line, f)| {
            Ok(TraceNode {
                name: f[0].to_owned(),
                cpu_milli: number(line, f[1])?,
                memory_mib: number(line, f[2])?,
                gpus: number(line, f[3])? as usize,
                model: model(f[4]).map_err(|e| format!("line {line}: {e}"))?,
            })
        })
        .collect::<Result<_, String>>()
        .map_err(|e| format!("{}: {e}", path.display()))
}

pub fn tasks(dir: &Path, variant: &str) -> Result<Vec<Task>, String> {
    let path = dir.join(format!("openb_pod_list_{variant}.csv"));
    let text = read(&path)?;
    // Some variants have no GPU-model column: their tasks run on any.
    let typed = text
        .lines()
        .next()
        .is_some_and(|h| h.split(',').any(|c| c == "gpu_spec"));
    let wanted = [
        "cpu_milli",
        "memory_mib",
        "num_gpu",
        "gpu_milli",
        "gpu_spec",
    ];
    rows(&text, &wanted[..if typed { 5 } else { 4 }])?
        .into_iter()
        .map(|(line, f)| {
            let models = f
                .get(4)
                .copied()
                .unwrap_or_default()
                .split('|')
                .filter(|m| !m.is_empty())
                .map(model)
                .try_fold(0u32, |bits, m| m.map(|m| bits | 1 << m))
                .map_err(|e| format!("line {line}: {e}"))?;
            let task = Task {
                cpu_milli: number(line, f[0])?,
                memory_mib: number(line, f[1])?,
                num_gpu: number(line, f[2])? as u32,
                gpu_milli: number(line, f[3])? as u32,
                models,
            };
            if task.num_gpu == 1 && !(1..=1000).contains(&task.gpu_milli) {
                return Err(format!(
                    "line {line}: gpu_milli {} of one GPU",
                    task.gpu_milli
                ));
            }
            Ok(task)
        })
        .collect::<Result<_, String>>()
        .map_err(|e| format!("{}: {e}", path.display()))
}
