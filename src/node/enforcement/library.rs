//! The library on the host: checked before anything is preloaded (a file
//! that is not a loadable shared object would make every process of the
//! container fail to start, or load nothing and cap nothing), and installed
//! atomically by the init container.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use super::{EnforcementError, io};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LibraryError {
    #[error("it does not exist")]
    Missing,
    #[error("it cannot be read: {0}")]
    Unreadable(String),
    #[error("it is not a regular file")]
    NotAFile,
    #[error("it is {0} bytes long, shorter than an ELF header")]
    Truncated(usize),
    #[error("it is not an ELF file (no \\x7fELF magic)")]
    NotElf,
    #[error("it is a 32-bit ELF file; a 64-bit shared object is needed")]
    WrongClass,
    #[error("it is a big-endian ELF file")]
    WrongEndian,
    #[error("it is an ELF {0}, not a shared object")]
    NotShared(&'static str),
    #[error("it is built for ELF machine {found}, this host is {host} ({want})")]
    WrongMachine {
        found: u16,
        want: u16,
        host: &'static str,
    },
}

/// ELF header fields (System V ABI): e_ident[EI_CLASS], e_ident[EI_DATA],
/// e_type and e_machine.
const ELFCLASS64: u8 = 2;
const ELFDATA2LSB: u8 = 1;
const ET_DYN: u16 = 3;
const EM_X86_64: u16 = 62;
const EM_AARCH64: u16 = 183;
const HEADER_LEN: usize = 64;

fn host_machine() -> (u16, &'static str) {
    if cfg!(target_arch = "aarch64") {
        (EM_AARCH64, "aarch64")
    } else {
        (EM_X86_64, "x86_64")
    }
}

/// Whether `header` (a file's first bytes) is a 64-bit little-endian shared
/// object for this host's machine.
pub(crate) fn check_header(header: &[u8]) -> Result<(), LibraryError> {
    if header.len() < 4 || &header[..4] != b"\x7fELF" {
        return Err(if header.len() < 4 && b"\x7fELF".starts_with(header) {
            LibraryError::Truncated(header.len())
        } else {
            LibraryError::NotElf
        });
    }
    if header.len() < HEADER_LEN {
        return Err(LibraryError::Truncated(header.len()));
    }
    if header[4] != ELFCLASS64 {
        return Err(LibraryError::WrongClass);
    }
    if header[5] != ELFDATA2LSB {
        return Err(LibraryError::WrongEndian);
    }
    let e_type = u16::from_le_bytes([header[16], header[17]]);
    if e_type != ET_DYN {
        return Err(LibraryError::NotShared(match e_type {
            1 => "relocatable object",
            2 => "executable",
            4 => "core dump",
            _ => "unknown type",
        }));
    }
    let found = u16::from_le_bytes([header[18], header[19]]);
    let (want, host) = host_machine();
    if found != want {
        return Err(LibraryError::WrongMachine { found, want, host });
    }
    Ok(())
}

/// The file at `path` exists, is readable and is a loadable shared object.
pub(crate) fn check_library(path: &Path) -> Result<(), EnforcementError> {
    let fail = |reason| EnforcementError::Library {
        path: path.to_owned(),
        reason,
    };
    let mut file = File::open(path).map_err(|e| {
        fail(if e.kind() == std::io::ErrorKind::NotFound {
            LibraryError::Missing
        } else {
            LibraryError::Unreadable(e.to_string())
        })
    })?;
    let meta = file
        .metadata()
        .map_err(|e| fail(LibraryError::Unreadable(e.to_string())))?;
    if !meta.is_file() {
        return Err(fail(LibraryError::NotAFile));
    }
    let mut header = Vec::with_capacity(HEADER_LEN);
    (&mut file)
        .take(HEADER_LEN as u64)
        .read_to_end(&mut header)
        .map_err(|e| fail(LibraryError::Unreadable(e.to_string())))?;
    check_header(&header).map_err(fail)
}

/// What [`install_library`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Installed {
    /// The same bytes were there already: left alone.
    Unchanged,
    /// Written under a temporary name, then renamed over the old one
    /// (running containers keep the copy they opened).
    Replaced,
}

/// Writes `bytes` to `dest` atomically: a temporary file in the same
/// directory, flushed to disk, then renamed over `dest`, and the directory
/// flushed. On failure the temporary file is removed and `dest` is as it was.
pub(crate) fn write_atomically(
    dest: &Path,
    bytes: &[u8],
    mode: u32,
) -> Result<(), EnforcementError> {
    use std::os::unix::fs::PermissionsExt;
    let dir = dest.parent().unwrap_or(Path::new("/"));
    let name = dest
        .file_name()
        .map_or_else(Default::default, |n| n.to_string_lossy());
    let tmp: PathBuf = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let write = || -> Result<(), EnforcementError> {
        let mut f = File::create(&tmp).map_err(io("create", &tmp))?;
        f.write_all(bytes).map_err(io("write", &tmp))?;
        f.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(io("set permissions of", &tmp))?;
        f.sync_all().map_err(io("flush", &tmp))?;
        std::fs::rename(&tmp, dest).map_err(io("rename into place", dest))?;
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io("flush", dir))
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Installs the library at `from` as `<to_dir>/libvgpu.so`, after checking
/// it, creating `to_dir` if needed.
pub fn install_library(from: &Path, to_dir: &Path) -> Result<Installed, EnforcementError> {
    check_library(from)?;
    let bytes = std::fs::read(from).map_err(io("read", from))?;
    let dest = to_dir.join(super::LIBRARY_FILE);
    if std::fs::read(&dest).is_ok_and(|old| old == bytes) {
        return Ok(Installed::Unchanged);
    }
    std::fs::create_dir_all(to_dir).map_err(io("create", to_dir))?;
    write_atomically(&dest, &bytes, 0o644)?;
    Ok(Installed::Replaced)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The C library this test process has loaded: a real shared object
    /// for this host, wherever the distribution keeps it.
    pub(crate) fn real_shared_object() -> PathBuf {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| p.contains("/libc.so") || p.contains("/libc-"))
            .map(PathBuf::from)
            .expect("no libc mapped")
    }

    fn reason(path: &Path) -> LibraryError {
        match check_library(path).unwrap_err() {
            EnforcementError::Library { reason, path: p } => {
                assert_eq!(p, path);
                reason
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn a_real_shared_object_passes() {
        check_library(&real_shared_object()).unwrap();
    }

    #[test]
    fn anything_else_is_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let real = std::fs::read(real_shared_object()).unwrap();
        let put = |name: &str, bytes: &[u8]| {
            let p = dir.path().join(name);
            std::fs::write(&p, bytes).unwrap();
            p
        };
        assert_eq!(reason(&dir.path().join("absent.so")), LibraryError::Missing);
        assert_eq!(reason(dir.path()), LibraryError::NotAFile);
        assert_eq!(
            reason(&put("text.so", b"not a library\n")),
            LibraryError::NotElf
        );
        assert_eq!(reason(&put("empty.so", b"")), LibraryError::Truncated(0));
        assert_eq!(
            reason(&put("short.so", &real[..20])),
            LibraryError::Truncated(20)
        );
        let mut class32 = real[..HEADER_LEN].to_vec();
        class32[4] = 1;
        assert_eq!(reason(&put("c32.so", &class32)), LibraryError::WrongClass);
        let mut exec = real[..HEADER_LEN].to_vec();
        exec[16] = 2;
        assert_eq!(
            reason(&put("exec.so", &exec)),
            LibraryError::NotShared("executable")
        );
        let mut arm = real[..HEADER_LEN].to_vec();
        let other = if host_machine().0 == EM_X86_64 {
            EM_AARCH64
        } else {
            EM_X86_64
        };
        arm[18..20].copy_from_slice(&other.to_le_bytes());
        let e = reason(&put("other.so", &arm));
        assert!(
            matches!(e, LibraryError::WrongMachine { found, .. } if found == other),
            "{e}"
        );
        let msg = check_library(&dir.path().join("text.so"))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("text.so") && msg.contains("not an ELF"),
            "{msg}"
        );
    }

    #[test]
    fn install_replaces_atomically_and_refuses_a_bad_source() {
        let dir = tempfile::tempdir().unwrap();
        let to = dir.path().join("host/vgpu");
        let src = real_shared_object();
        assert_eq!(install_library(&src, &to).unwrap(), Installed::Replaced);
        let dest = to.join(LIBRARY_FILE_NAME);
        assert_eq!(std::fs::read(&dest).unwrap(), std::fs::read(&src).unwrap());
        // A running container holds the old copy open: it keeps its bytes.
        let held = File::open(&dest).unwrap();
        let old_inode = std::os::unix::fs::MetadataExt::ino(&held.metadata().unwrap());
        assert_eq!(install_library(&src, &to).unwrap(), Installed::Unchanged);
        std::fs::write(&dest, b"stale").unwrap();
        assert_eq!(install_library(&src, &to).unwrap(), Installed::Replaced);
        let new_inode = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&dest).unwrap());
        assert_ne!(old_inode, new_inode);
        let text = dir.path().join("text.so");
        std::fs::write(&text, "x").unwrap();
        assert!(install_library(&text, &to).is_err());
        assert_eq!(std::fs::read(&dest).unwrap(), std::fs::read(&src).unwrap());
        let names: Vec<_> = std::fs::read_dir(&to)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            [LIBRARY_FILE_NAME],
            "a temporary file was left behind"
        );
    }

    const LIBRARY_FILE_NAME: &str = super::super::LIBRARY_FILE;
}
