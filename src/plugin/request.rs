//! GetPreferredAllocation's request, decoded without a heap string per ID.
//!
//! The kubelet lists every free device ID in it (160,000 for two 80 GB GPUs
//! at 1 MiB units); the generated type would allocate a `String` for each
//! before the handler runs. The server takes these types instead (see
//! `build.rs`): each repeated ID field is one byte buffer plus offsets.
//! IDs are compared as bytes, so no UTF-8 check is needed either.

use prost::DecodeError;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{
    DecodeContext, WireType, check_wire_type, decode_varint, encode_key, encode_varint,
    encoded_len_varint, int32, message, skip_field,
};

/// prost offers hand-written decoders no other way to build its error.
#[allow(deprecated)]
fn error(what: &'static str) -> DecodeError {
    DecodeError::new(what)
}

/// A `repeated string` field held as one buffer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdList {
    bytes: Vec<u8>,
    ends: Vec<u32>,
}

impl IdList {
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &[u8]> + '_ {
        (0..self.ends.len()).map(|i| {
            let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
            &self.bytes[start..self.ends[i] as usize]
        })
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    fn merge(&mut self, wire_type: WireType, buf: &mut impl Buf) -> Result<(), DecodeError> {
        check_wire_type(WireType::LengthDelimited, wire_type)?;
        let len = usize::try_from(decode_varint(buf)?)
            .map_err(|_| error("device ID length overflows"))?;
        if len > buf.remaining() {
            return Err(error("buffer underflow"));
        }
        let start = self.bytes.len();
        self.bytes.resize(start + len, 0);
        buf.copy_to_slice(&mut self.bytes[start..]);
        let end = u32::try_from(self.bytes.len()).map_err(|_| error("request over 4 GiB"))?;
        self.ends.push(end);
        Ok(())
    }

    fn encode(&self, tag: u32, buf: &mut impl BufMut) {
        for id in self.iter() {
            encode_key(tag, WireType::LengthDelimited, buf);
            encode_varint(id.len() as u64, buf);
            buf.put_slice(id);
        }
    }

    fn encoded_len(&self) -> usize {
        self.iter()
            .map(|id| 1 + encoded_len_varint(id.len() as u64) + id.len())
            .sum()
    }
}

impl<'a> FromIterator<&'a str> for IdList {
    fn from_iter<I: IntoIterator<Item = &'a str>>(iter: I) -> Self {
        let mut list = IdList::default();
        for id in iter {
            list.bytes.extend_from_slice(id.as_bytes());
            list.ends.push(list.bytes.len() as u32);
        }
        list
    }
}

/// `ContainerPreferredAllocationRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerPreferred {
    pub available: IdList,
    pub must_include: IdList,
    pub size: i32,
}

impl prost::Message for ContainerPreferred {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        self.available.encode(1, buf);
        self.must_include.encode(2, buf);
        if self.size != 0 {
            int32::encode(3, &self.size, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        match tag {
            1 => self.available.merge(wire_type, buf),
            2 => self.must_include.merge(wire_type, buf),
            3 => int32::merge(wire_type, &mut self.size, buf, ctx),
            _ => skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let size = if self.size != 0 {
            int32::encoded_len(3, &self.size)
        } else {
            0
        };
        self.available.encoded_len() + self.must_include.encoded_len() + size
    }

    fn clear(&mut self) {
        *self = ContainerPreferred::default();
    }
}

/// `PreferredAllocationRequest`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PreferredRequest {
    pub containers: Vec<ContainerPreferred>,
}

impl prost::Message for PreferredRequest {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        for c in &self.containers {
            message::encode(1, c, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        match tag {
            1 => message::merge_repeated(wire_type, &mut self.containers, buf, ctx),
            _ => skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        message::encoded_len_repeated(1, &self.containers)
    }

    fn clear(&mut self) {
        self.containers.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api;
    use prost::Message;

    #[test]
    fn decodes_what_the_generated_type_encodes_and_back() {
        let generated = api::PreferredAllocationRequest {
            container_requests: vec![
                api::ContainerPreferredAllocationRequest {
                    available_device_i_ds: vec![
                        "a0".into(),
                        "a1".into(),
                        "".into(),
                        "GPU-x".into(),
                    ],
                    must_include_device_i_ds: vec!["a1".into()],
                    allocation_size: 2,
                },
                api::ContainerPreferredAllocationRequest::default(),
            ],
        };
        let bytes = generated.encode_to_vec();
        let ours = PreferredRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(ours.containers.len(), 2);
        let c = &ours.containers[0];
        let ids: Vec<&[u8]> = c.available.iter().collect();
        assert_eq!(ids, vec![&b"a0"[..], b"a1", b"", b"GPU-x"]);
        assert_eq!(c.must_include.iter().collect::<Vec<_>>(), vec![&b"a1"[..]]);
        assert_eq!(c.size, 2);
        assert_eq!(ours.encode_to_vec(), bytes);
        assert_eq!(ours.encoded_len(), bytes.len());
    }

    #[test]
    fn truncated_input_is_an_error_not_a_panic() {
        let generated = api::PreferredAllocationRequest {
            container_requests: vec![api::ContainerPreferredAllocationRequest {
                available_device_i_ds: vec!["abcdef".into()],
                ..Default::default()
            }],
        };
        let bytes = generated.encode_to_vec();
        for cut in 1..bytes.len() {
            assert!(
                PreferredRequest::decode(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
    }
}
