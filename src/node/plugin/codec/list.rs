//! The ListAndWatch message, encoded straight from the device model.
//!
//! The generated server takes this type in place of `ListAndWatchResponse`
//! (see `build.rs`), so a list of 160,000 devices costs no heap per device:
//! IDs are written into the gRPC buffer as they are produced. The bytes are
//! exactly what prost would write for the generated type (unit-tested).

use std::sync::Arc;

use prost::DecodeError;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{DecodeContext, WireType, encode_key, encode_varint, skip_field};

use crate::rules::device::{DeviceModel, HEALTHY, UNHEALTHY, device_len, numa_len, topology_len};

/// One ListAndWatch message: every device of a model with its GPU's health,
/// or the empty list a stopping plugin sends.
#[derive(Clone, Default)]
pub(crate) struct DeviceListMessage {
    inner: Option<(Arc<DeviceModel>, Arc<[bool]>)>,
}

impl std::fmt::Debug for DeviceListMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceListMessage")
            .field("devices", &self.device_count())
            .field("healthy_gpus", &self.inner.as_ref().map(|(_, h)| h.clone()))
            .finish()
    }
}

impl DeviceListMessage {
    pub(crate) fn new(model: Arc<DeviceModel>, healthy: Arc<[bool]>) -> Self {
        assert_eq!(model.gpus().len(), healthy.len());
        DeviceListMessage {
            inner: Some((model, healthy)),
        }
    }

    pub(crate) fn empty() -> Self {
        DeviceListMessage::default()
    }

    pub(crate) fn device_count(&self) -> u64 {
        self.inner.as_ref().map_or(0, |(m, _)| m.device_count())
    }

    /// Devices whose GPU is healthy.
    pub(crate) fn healthy_count(&self) -> u64 {
        self.inner.as_ref().map_or(0, |(m, h)| {
            (0..h.len())
                .filter(|g| h[*g])
                .map(|g| u64::from(m.units(g)))
                .sum()
        })
    }
}

fn put_str(tag: u32, s: &str, buf: &mut impl BufMut) {
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(s.len() as u64, buf);
    buf.put_slice(s.as_bytes());
}

impl prost::Message for DeviceListMessage {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        let Some((model, healthy)) = &self.inner else {
            return;
        };
        model.for_each_id(|gpu, id| {
            let health = if healthy[gpu] { HEALTHY } else { UNHEALTHY };
            let numa = model.topology(gpu);
            encode_key(1, WireType::LengthDelimited, buf);
            encode_varint(device_len(id.len(), health, numa) as u64, buf);
            put_str(1, id, buf);
            put_str(2, health, buf);
            if let Some(node) = numa {
                encode_key(3, WireType::LengthDelimited, buf);
                encode_varint(topology_len(node) as u64, buf);
                encode_key(1, WireType::LengthDelimited, buf);
                encode_varint(numa_len(node) as u64, buf);
                if node != 0 {
                    encode_key(1, WireType::Varint, buf);
                    encode_varint(u64::from(node), buf);
                }
            }
        });
    }

    /// The plugin only sends this message; anything read is skipped.
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.inner.as_ref().map_or(0, |(m, h)| m.wire_len(|g| h[g]))
    }

    fn clear(&mut self) {
        self.inner = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api;
    use crate::rules::device::model_tests::{config, eager_list, gpu};
    use crate::rules::device::{Plan, Resource};
    use prost::Message;

    #[test]
    fn bytes_equal_the_generated_encoding_and_decode() {
        let gpus = vec![
            gpu(0, 2_000, Some(0)),
            gpu(1, 1_300, Some(200)),
            gpu(2, 40, None),
        ];
        let plan = Plan::new(config(&Resource::ALL, 1), gpus).unwrap();
        for m in plan.models() {
            let healthy: Arc<[bool]> = vec![true, false, true].into();
            let lazy = DeviceListMessage::new(m.clone(), healthy.clone());
            let bytes = lazy.encode_to_vec();
            assert_eq!(bytes.len(), lazy.encoded_len());
            assert_eq!(
                bytes,
                eager_list(m, &healthy).encode_to_vec(),
                "{}",
                m.resource()
            );
            let back = api::ListAndWatchResponse::decode(bytes.as_slice()).unwrap();
            assert_eq!(back.devices.len() as u64, m.device_count());
            assert_eq!(
                back.devices.iter().filter(|d| d.health == HEALTHY).count() as u64,
                lazy.healthy_count()
            );
        }
    }

    #[test]
    fn empty_list_is_empty() {
        let e = DeviceListMessage::empty();
        assert!(e.encode_to_vec().is_empty());
        assert_eq!(e.device_count(), 0);
    }
}
