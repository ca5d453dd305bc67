//! The deployment's handoff secret, as this process holds it: read once, turned into the keys of
//! `kvgate_proto::auth`, and never printed.

use std::path::Path;

use kvgate_proto::auth::{DeploymentKey, KeyError};

/// Why the secret could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("reading --handoff-secret-file {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("--handoff-secret-file {path}: {source}")]
    Invalid { path: String, source: KeyError },
    #[error(
        "--handoff-secret-file {path} has mode {mode:04o}: other users may read or write it; refusing it, as ssh refuses such a private key (chmod o-rwx {path}; kvgate's pods mount it 0400 with the pod's fsGroup)"
    )]
    OpenToOthers { path: String, mode: u32 },
}

/// The keys derived from the deployment's handoff secret.
#[derive(Clone, Debug)]
pub struct Secret(DeploymentKey);

impl Secret {
    pub fn new(bytes: &[u8]) -> Result<Self, KeyError> {
        DeploymentKey::new(bytes).map(Secret)
    }

    /// A fresh random secret, for a process that runs every role itself (`local`).
    pub fn random() -> Self {
        let bytes: [u8; 32] = rand::random();
        Secret::new(&bytes).expect("32 bytes are enough")
    }

    pub fn from_file(path: &Path) -> Result<Self, SecretError> {
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display().to_string();
        let mode = std::fs::metadata(path).map_err(|source| SecretError::Read { path: shown.clone(), source })?.permissions().mode() & 0o7777;
        if mode & 0o007 != 0 {
            return Err(SecretError::OpenToOthers { path: shown, mode });
        }
        let bytes = std::fs::read(path).map_err(|source| SecretError::Read { path: shown.clone(), source })?;
        // Trailing newlines from `echo > file` are not part of the secret.
        Secret::new(bytes.trim_ascii_end()).map_err(|source| SecretError::Invalid { path: shown, source })
    }

    pub fn key(&self) -> &DeploymentKey {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_never_printed_and_must_be_long_enough() {
        let s = Secret::new(b"super-secret-value-123").unwrap();
        assert!(!format!("{s:?}").contains("super"));
        assert!(Secret::new(b"short").unwrap_err().to_string().contains("16 bytes"));
    }

    #[test]
    fn a_secret_file_open_to_others_is_refused_loses_its_trailing_newline_and_names_itself_when_bad() {
        let dir = std::env::temp_dir().join(format!("kvgate-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a"), dir.join("b"));
        std::fs::write(&a, "0123456789abcdef0123\n").unwrap();
        std::fs::write(&b, "short\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        for (path, mode) in [(&a, 0o644), (&b, 0o666)] {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = Secret::from_file(path).unwrap_err().to_string();
            assert!(err.contains(&format!("mode {mode:04o}")) && err.contains("chmod o-rwx"), "{err}");
        }
        for path in [&a, &b] {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o440)).unwrap();
        }
        let from_file = Secret::from_file(&a).unwrap();
        let direct = Secret::new(b"0123456789abcdef0123").unwrap();
        let id = kvgate_proto::handoff::HandoffId(1);
        assert_eq!(
            from_file.key().frame_key(id, kvgate_proto::handoff::TenantTag::default()).mac(&[b"x"]),
            direct.key().frame_key(id, kvgate_proto::handoff::TenantTag::default()).mac(&[b"x"])
        );
        let err = Secret::from_file(&b).unwrap_err().to_string();
        assert!(err.contains(&b.display().to_string()) && err.contains("16 bytes"), "{err}");
        let err = Secret::from_file(&dir.join("missing")).unwrap_err().to_string();
        assert!(err.contains("missing"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
