//! Device IDs. Every byte of an ID is paid once per device in a ListAndWatch
//! message the kubelet caps at 4 MiB, so gpu-memory and gpu-core IDs are a
//! short GPU tag followed by the unit's index, both in lowercase base 36:
//! `k3` is unit 111 of the GPU tagged `k`. The tag is a hash of the GPU's
//! UUID, never its NVML index (which can change across reboots), and all tags
//! of a node have one length, the smallest that keeps them distinct, so an ID
//! splits without a separator. gpu-count IDs are the GPU's UUID itself.

const ALPHABET: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
/// Base-36 digits of a u64: the longest tag there can be.
const MAX_TAG_LEN: usize = 13;
/// Base-36 digits of a u32 unit index.
const MAX_INDEX_LEN: usize = 7;
pub(crate) const MAX_ID_LEN: usize = MAX_TAG_LEN + MAX_INDEX_LEN;

/// Why a GPU UUID cannot be a device ID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum UuidError {
    #[error("{0:?} must be 1 to 63 characters (it is a gpu-count device ID)")]
    Length(String),
    #[error("{0:?} may hold only [A-Za-z0-9-_.]")]
    Characters(String),
}

/// The kubelet's (and our) rule for a GPU UUID used as a device ID.
pub(crate) fn validate_uuid(uuid: &str) -> Result<(), UuidError> {
    if uuid.is_empty() || uuid.len() > 63 {
        return Err(UuidError::Length(uuid.to_owned()));
    }
    if !uuid
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(UuidError::Characters(uuid.to_owned()));
    }
    Ok(())
}

/// FNV-1a: stable across builds and platforms, unlike std's hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn base36_digits(mut v: u64, out: &mut [u8; MAX_TAG_LEN]) -> &[u8] {
    let mut i = MAX_TAG_LEN;
    loop {
        i -= 1;
        out[i] = ALPHABET[(v % 36) as usize];
        v /= 36;
        if v == 0 {
            break;
        }
    }
    &out[i..]
}

/// Number of base-36 digits of `v` (1 for 0).
pub(crate) fn index_len(v: u32) -> usize {
    let mut n = 1;
    let mut v = v / 36;
    while v > 0 {
        n += 1;
        v /= 36;
    }
    n
}

/// The per-GPU tags of one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tags {
    tags: Vec<[u8; MAX_TAG_LEN]>,
    len: usize,
}

impl Tags {
    /// `None` only if two UUIDs hash to the same 64 bits (duplicate UUIDs).
    pub(crate) fn new<'a>(uuids: impl IntoIterator<Item = &'a str>) -> Option<Tags> {
        let full: Vec<[u8; MAX_TAG_LEN]> = uuids
            .into_iter()
            .map(|u| {
                // Zero-padded so that every GPU has the same digits to cut from.
                let mut buf = [0u8; MAX_TAG_LEN];
                let digits = base36_digits(fnv1a(u.as_bytes()), &mut buf).to_vec();
                let mut padded = [b'0'; MAX_TAG_LEN];
                padded[MAX_TAG_LEN - digits.len()..].copy_from_slice(&digits);
                padded
            })
            .collect();
        // The low digits vary most: tag = the last `len` digits.
        (1..=MAX_TAG_LEN).find_map(|len| {
            let cut = |t: &[u8; MAX_TAG_LEN]| t[MAX_TAG_LEN - len..].to_vec();
            let mut seen: Vec<Vec<u8>> = full.iter().map(cut).collect();
            seen.sort();
            seen.dedup();
            (seen.len() == full.len()).then(|| Tags {
                tags: full.clone(),
                len,
            })
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn tag(&self, gpu: usize) -> &str {
        let t = &self.tags[gpu][MAX_TAG_LEN - self.len..];
        std::str::from_utf8(t).expect("tags are ASCII")
    }

    /// Writes `<tag><index>` into `buf` and returns it.
    pub(crate) fn encode<'b>(
        &self,
        gpu: usize,
        index: u32,
        buf: &'b mut [u8; MAX_ID_LEN],
    ) -> &'b str {
        let tag = self.tag(gpu).as_bytes();
        buf[..tag.len()].copy_from_slice(tag);
        let mut digits = [0u8; MAX_TAG_LEN];
        let idx = base36_digits(u64::from(index), &mut digits);
        let end = tag.len() + idx.len();
        buf[tag.len()..end].copy_from_slice(idx);
        std::str::from_utf8(&buf[..end]).expect("IDs are ASCII")
    }

    /// Splits an ID into (GPU position, unit index); `None` if it is not one
    /// of ours or not in canonical form (so no two strings name one device).
    /// Hot: GetPreferredAllocation decodes every free ID of the node.
    pub(crate) fn decode(&self, id: &[u8]) -> Option<(usize, u32)> {
        if id.len() <= self.len || id.len() > self.len + MAX_INDEX_LEN {
            return None;
        }
        let (tag, idx) = id.split_at(self.len);
        let gpu = self
            .tags
            .iter()
            .position(|t| &t[MAX_TAG_LEN - self.len..] == tag)?;
        if idx.len() > 1 && idx[0] == b'0' {
            return None;
        }
        let mut v: u64 = 0;
        for &c in idx {
            let d = DIGIT[c as usize];
            if d == NOT_A_DIGIT {
                return None;
            }
            v = v * 36 + u64::from(d);
        }
        Some((gpu, u32::try_from(v).ok()?))
    }
}

const NOT_A_DIGIT: u8 = u8::MAX;
/// Byte → base-36 digit value, or NOT_A_DIGIT.
const DIGIT: [u8; 256] = {
    let mut table = [NOT_A_DIGIT; 256];
    let mut i = 0;
    while i < ALPHABET.len() {
        table[ALPHABET[i] as usize] = i as u8;
        i += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    fn uuids(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("GPU-{i:08x}-1111-2222-3333-444455556666"))
            .collect()
    }

    #[test]
    fn ids_round_trip_and_are_short() {
        let u = uuids(8);
        let tags = Tags::new(u.iter().map(String::as_str)).unwrap();
        assert!(
            tags.len() <= 3,
            "8 GPUs need at most 3 tag chars, got {}",
            tags.len()
        );
        let mut buf = [0u8; MAX_ID_LEN];
        for gpu in 0..8 {
            for index in [0, 1, 35, 36, 1295, 1296, 81_919, u32::MAX] {
                let id = tags.encode(gpu, index, &mut buf).to_owned();
                assert_eq!(id.len(), tags.len() + index_len(index));
                assert_eq!(tags.decode(id.as_bytes()), Some((gpu, index)), "{id}");
            }
        }
    }

    #[test]
    fn tags_are_stable_and_independent_of_order() {
        let u = uuids(4);
        let a = Tags::new(u.iter().map(String::as_str)).unwrap();
        let b = Tags::new(u.iter().rev().map(String::as_str)).unwrap();
        assert_eq!(a.tag(0), b.tag(3));
        // A fixed UUID always gets the same tag: IDs survive restarts.
        let one = Tags::new(["GPU-8d1b5a2c-0000-4000-8000-00000000abcd"]).unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(
            one.tag(0),
            Tags::new(["GPU-8d1b5a2c-0000-4000-8000-00000000abcd"])
                .unwrap()
                .tag(0)
        );
    }

    #[test]
    fn tags_grow_until_distinct() {
        let u = uuids(200);
        let tags = Tags::new(u.iter().map(String::as_str)).unwrap();
        let mut all: Vec<&str> = (0..200).map(|g| tags.tag(g)).collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 200);
        assert!(Tags::new(["GPU-a", "GPU-a"]).is_none());
    }

    #[test]
    fn foreign_and_non_canonical_ids_are_rejected() {
        let u = uuids(2);
        let tags = Tags::new(u.iter().map(String::as_str)).unwrap();
        let mut buf = [0u8; MAX_ID_LEN];
        let id = tags.encode(0, 5, &mut buf).to_owned();
        let tag = tags.tag(0).to_owned();
        assert_eq!(
            tags.decode(format!("{tag}05").as_bytes()),
            None,
            "leading zero"
        );
        assert_eq!(tags.decode(format!("{tag}5").as_bytes()), Some((0, 5)));
        assert_eq!(
            tags.decode(id.to_uppercase().as_bytes())
                .filter(|_| id != id.to_uppercase()),
            None
        );
        assert_eq!(tags.decode(tag.as_bytes()), None, "tag alone");
        assert_eq!(tags.decode(b""), None);
        assert_eq!(
            tags.decode(format!("{tag}zzzzzzzz").as_bytes()),
            None,
            "too long"
        );
        assert_eq!(tags.decode(format!("{tag}-1").as_bytes()), None);
    }

    #[test]
    fn uuid_rules() {
        assert!(validate_uuid("GPU-8d1b5a2c-0000-4000-8000-00000000abcd").is_ok());
        assert!(validate_uuid("").is_err());
        assert!(validate_uuid("GPU a").is_err());
        assert!(validate_uuid(&"a".repeat(64)).is_err());
    }
}
