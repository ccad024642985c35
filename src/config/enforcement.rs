//! The `[enforcement]` config section: whether shared grants preload
//! HAMi-core, who limits a gpu-core grant (HAMi-core or MPS), where
//! HAMi-core's library and per-container state and MPS's directories and
//! control binary live on the host, and where they appear inside a
//! container.

use std::path::{Component, Path, PathBuf};

use serde::Deserialize;

use crate::config::ConfigError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// The limit envs are set and nothing reads them: a shared grant is
    /// bookkeeping only.
    None,
    /// Shared grants preload HAMi-core (`libvgpu.so`), which caps them.
    HamiCore,
}

/// How HAMi-core applies a gpu-core grant (`CUDA_DEVICE_SM_LIMIT`): its
/// `GPU_CORE_UTILIZATION_POLICY`, handed to every shared grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CorePolicy {
    /// The grant is a cap, alone on the GPU or not: 25 % runs at 25 %.
    Force,
    /// HAMi-core's own default: the grant caps the container only while
    /// other processes use the GPU; alone, it takes the whole GPU (a lone
    /// container granted 25 % of an H100 ran at 682 TFLOP/s, against 680
    /// with no limit).
    Default,
    /// The compute grant is not applied at all: bookkeeping only (memory
    /// limits still hold).
    Disable,
}

/// Who limits a gpu-core grant. Two keys rather than one backend name,
/// because the two limits are separate choices: HAMi-core's memory cap and
/// usage region are worth having under MPS too, while its compute limit does
/// not hold for few-block kernels (see deploy/README.md, *What a gpu-core grant guarantees*).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Compute {
    /// Bookkeeping only: the grant's envs are set, nothing limits them.
    None,
    /// HAMi-core throttles kernel launches (`CUDA_DEVICE_SM_LIMIT`, under
    /// `core_policy`); needs `mode = "hami-core"`.
    HamiCore,
    /// Each shared grant is an MPS client of its GPU's control daemon, run
    /// by this daemon: the driver caps its SMs
    /// (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`) and its memory
    /// (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`).
    Mps,
}

/// The MPS control daemons this daemon runs, one per GPU, and what a
/// shared grant's container mounts to reach its GPU's.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MpsConfig {
    /// `nvidia-cuda-mps-control`, as the daemon sees it: it starts the
    /// control daemons (`-d`) and talks to them (its client mode).
    pub control_binary: PathBuf,
    /// Host directory of the control daemons' pipes, one subdirectory per
    /// GPU (its UUID); the daemon sees it at the same path.
    pub pipe_dir: PathBuf,
    /// Host directory of their logs, one subdirectory per GPU.
    pub log_dir: PathBuf,
    /// Host directory the daemon's pod has as its `/dev/shm`: MPS servers
    /// and their clients share memory there, so a client mounts it too.
    pub shm_dir: PathBuf,
    /// Where a client's GPU pipe directory is mounted; its
    /// `CUDA_MPS_PIPE_DIRECTORY`.
    pub container_pipe_dir: PathBuf,
}

impl Default for MpsConfig {
    fn default() -> Self {
        MpsConfig {
            control_binary: "/usr/bin/nvidia-cuda-mps-control".into(),
            pipe_dir: "/var/run/gpu-device-plugin/mps/pipe".into(),
            log_dir: "/var/log/gpu-device-plugin/mps".into(),
            shm_dir: "/var/run/gpu-device-plugin/mps/shm".into(),
            container_pipe_dir: "/var/run/nvidia-mps".into(),
        }
    }
}

impl CorePolicy {
    /// The value HAMi-core reads.
    pub(crate) fn env_value(self) -> &'static str {
        match self {
            CorePolicy::Force => "force",
            CorePolicy::Default => "default",
            CorePolicy::Disable => "disable",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnforcementConfig {
    pub mode: Mode,
    /// How a gpu-core grant is applied; `force` so that a grant is a cap
    /// whether or not the container is alone on its GPU.
    pub core_policy: CorePolicy,
    /// Host directory holding `libvgpu.so`; the daemon sees it at the same
    /// path. HAMi installs into /usr/local/vgpu, so pointing here at a HAMi
    /// node needs no change.
    pub library_dir: PathBuf,
    /// Host directory for the `ld.so.preload` file, the per-container cache
    /// directories and HAMi-core's lock directory; the daemon sees it at the
    /// same path.
    pub state_dir: PathBuf,
    /// Where the library is mounted in a container; `ld.so.preload` names
    /// this path.
    pub(crate) container_library_path: PathBuf,
    /// Where a container's own cache directory is mounted; HAMi-core's
    /// usage region is a file in it.
    pub(crate) container_cache_dir: PathBuf,
    /// Without pod matching nothing says which containers live: cache
    /// directories last made longer ago than this are removed (0: never).
    /// With pod matching, those of pods gone are removed instead.
    pub(crate) cache_max_age_s: u64,
    /// Who limits a gpu-core grant; unset: HAMi-core when it is preloaded,
    /// else nothing (see [`EnforcementConfig::compute`]).
    pub(crate) compute: Option<Compute>,
    pub mps: MpsConfig,
}

impl Default for EnforcementConfig {
    fn default() -> Self {
        EnforcementConfig {
            mode: Mode::None,
            core_policy: CorePolicy::Force,
            library_dir: "/usr/local/vgpu".into(),
            state_dir: "/var/lib/gpu-device-plugin".into(),
            container_library_path: "/usr/local/vgpu/libvgpu.so".into(),
            container_cache_dir: "/usr/local/vgpu/cache".into(),
            cache_max_age_s: 7 * 24 * 3600,
            compute: None,
            mps: MpsConfig::default(),
        }
    }
}

fn invalid(key: &str, reason: String) -> ConfigError {
    ConfigError::Invalid {
        key: format!("enforcement.{key}"),
        reason,
    }
}

/// Characters a configured path may hold. glibc splits `ld.so.preload` on
/// spaces, tabs, newlines and colons, and mount paths travel through the
/// container runtime's option strings, so anything else is refused rather
/// than escaped.
fn path_char_ok(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '/' | '.' | '_' | '-' | '+' | '@')
}

/// An absolute, normalised path of plain characters, or why not.
pub(crate) fn check_path(key: &str, path: &Path) -> Result<(), ConfigError> {
    let bad = |reason: String| Err(invalid(key, reason));
    let text = path
        .to_str()
        .ok_or_else(|| invalid(key, format!("{} is not UTF-8", path.display())))?;
    if let Some(c) = text.chars().find(|&c| !path_char_ok(c)) {
        return bad(format!(
            "{text:?} holds {c:?}; use letters, digits and / . _ - + @ only \
             (whitespace or a colon would split the ld.so.preload entry)"
        ));
    }
    if !path.is_absolute() {
        return bad(format!("{text:?} is not an absolute path"));
    }
    if path
        .components()
        .any(|c| matches!(c, Component::CurDir | Component::ParentDir))
        || text.contains("//")
        || (text.len() > 1 && text.ends_with('/'))
    {
        return bad(format!(
            "{text:?} is not normalised (no ., .., // or trailing /)"
        ));
    }
    if path.parent().is_none() {
        return bad("the root directory is not allowed".into());
    }
    Ok(())
}

impl EnforcementConfig {
    /// Who limits a gpu-core grant.
    pub fn compute(&self) -> Compute {
        match (self.compute, self.mode) {
            (Some(c), _) => c,
            (None, Mode::HamiCore) => Compute::HamiCore,
            (None, Mode::None) => Compute::None,
        }
    }

    /// What holds a shared grant to its share, as `/metrics` names it:
    /// `mps` (the driver, as an MPS client), `hami-core` (the preloaded
    /// library) or `none` (bookkeeping only).
    pub fn backend(&self) -> &'static str {
        match (self.compute(), self.mode) {
            (Compute::Mps, _) => "mps",
            (_, Mode::HamiCore) => "hami-core",
            (_, Mode::None) => "none",
        }
    }

    /// Every path checked, each error naming its `enforcement.*` key.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let mps = &self.mps;
        for (key, path) in [
            ("library_dir", &self.library_dir),
            ("state_dir", &self.state_dir),
            ("container_library_path", &self.container_library_path),
            ("container_cache_dir", &self.container_cache_dir),
            ("mps.control_binary", &mps.control_binary),
            ("mps.pipe_dir", &mps.pipe_dir),
            ("mps.log_dir", &mps.log_dir),
            ("mps.shm_dir", &mps.shm_dir),
            ("mps.container_pipe_dir", &mps.container_pipe_dir),
        ] {
            check_path(key, path)?;
        }
        if self.compute() == Compute::HamiCore && self.mode != Mode::HamiCore {
            return Err(invalid(
                "compute",
                "\"hami-core\" limits compute through the preloaded library: it needs \
                 mode = \"hami-core\""
                    .into(),
            ));
        }
        if self
            .container_library_path
            .starts_with(&self.container_cache_dir)
        {
            return Err(invalid(
                "container_library_path",
                format!(
                    "{} is inside container_cache_dir {}: the library would sit in the \
                     container's writable cache mount",
                    self.container_library_path.display(),
                    self.container_cache_dir.display()
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<EnforcementConfig, String> {
        let c: EnforcementConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }

    #[test]
    fn defaults_are_off_with_hami_paths() {
        let c = parse("").unwrap();
        assert_eq!(c.mode, Mode::None);
        assert_eq!(c.library_dir, Path::new("/usr/local/vgpu"));
        assert_eq!(parse("mode = \"hami-core\"").unwrap().mode, Mode::HamiCore);
        assert_eq!(c.core_policy, CorePolicy::Force);
        let c = parse("core_policy = \"default\"").unwrap();
        assert_eq!(c.core_policy.env_value(), "default");
        assert_eq!(
            parse("core_policy = \"disable\"").unwrap().core_policy,
            CorePolicy::Disable
        );
    }

    #[test]
    fn compute_follows_the_preload_unless_set() {
        assert_eq!(parse("").unwrap().compute(), Compute::None);
        let hami = "mode = \"hami-core\"";
        assert_eq!(parse(hami).unwrap().compute(), Compute::HamiCore);
        let both = parse(&format!("{hami}\ncompute = \"mps\"")).unwrap();
        assert_eq!(both.compute(), Compute::Mps);
        assert_eq!(both.backend(), "mps");
        assert_eq!(parse(hami).unwrap().backend(), "hami-core");
        assert_eq!(parse("").unwrap().backend(), "none");
        let mps = parse("compute = \"mps\"\n[mps]\npipe_dir = \"/run/mps\"").unwrap();
        assert_eq!(mps.compute(), Compute::Mps);
        assert_eq!(mps.mode, Mode::None);
        assert_eq!(mps.mps.pipe_dir, Path::new("/run/mps"));
        assert_eq!(mps.mps.log_dir, MpsConfig::default().log_dir);
    }

    #[test]
    fn bad_values_name_their_key() {
        for (text, key) in [
            ("mode = \"hami\"", "mode"),
            ("core_policy = \"strict\"", "force"),
            ("colour = 1", "colour"),
            (
                "library_dir = \"usr/local/vgpu\"",
                "enforcement.library_dir",
            ),
            ("state_dir = \"/var/lib/a b\"", "enforcement.state_dir"),
            (
                "container_library_path = \"/x/lib.so\\n/evil.so\"",
                "enforcement.container_library_path",
            ),
            (
                "container_library_path = \"/x:/y.so\"",
                "enforcement.container_library_path",
            ),
            (
                "container_cache_dir = \"/a/../b\"",
                "enforcement.container_cache_dir",
            ),
            (
                "container_cache_dir = \"/\"",
                "enforcement.container_cache_dir",
            ),
            (
                "container_cache_dir = \"/usr/local/vgpu\"",
                "enforcement.container_library_path",
            ),
            ("compute = \"hami-core\"", "enforcement.compute"),
            ("compute = \"mig\"", "compute"),
            ("[mps]\npipe_dir = \"run/mps\"", "enforcement.mps.pipe_dir"),
            (
                "[mps]\ncontrol_binary = \"/bin/a b\"",
                "enforcement.mps.control_binary",
            ),
            ("[mps]\npipes = \"/x\"", "pipes"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(key), "{text}: {e}");
        }
    }
}
