// Writes sizeof/offsetof of every device handle as the device compiler sees
// them, so a GPU test can compare with the Rust #[repr(C)] mirrors.
#include <comm/fifo_device.cuh>
#include <comm/memory_channel_device.cuh>
#include <comm/packet_device.cuh>
#include <comm/port_channel_device.cuh>
#include <comm/semaphore_device.cuh>

#define PROBE(expr) out[n++] = static_cast<uint64_t>(expr)

// The order here is the order of comm::device_handles::LAYOUT_PROBE.
extern "C" __global__ void comm_layout_probe(uint64_t* out) {
  using namespace comm;
  int n = 0;
  PROBE(sizeof(DeviceError));
  PROBE(offsetof(DeviceError, kind));
  PROBE(offsetof(DeviceError, rank));
  PROBE(offsetof(DeviceError, peer));
  PROBE(offsetof(DeviceError, id));
  PROBE(offsetof(DeviceError, expected));
  PROBE(offsetof(DeviceError, observed));
  PROBE(sizeof(SemaphoreDeviceHandle));
  PROBE(offsetof(SemaphoreDeviceHandle, expected_inbound));
  PROBE(offsetof(SemaphoreDeviceHandle, reserved));
  PROBE(offsetof(SemaphoreDeviceHandle, remote_inbound));
  PROBE(offsetof(SemaphoreDeviceHandle, error));
  PROBE(offsetof(SemaphoreDeviceHandle, rank));
  PROBE(offsetof(SemaphoreDeviceHandle, peer));
  PROBE(offsetof(SemaphoreDeviceHandle, id));
  PROBE(sizeof(ProxyTrigger));
  PROBE(sizeof(FifoDeviceHandle));
  PROBE(offsetof(FifoDeviceHandle, head));
  PROBE(offsetof(FifoDeviceHandle, tail));
  PROBE(offsetof(FifoDeviceHandle, tail_replica));
  PROBE(offsetof(FifoDeviceHandle, error));
  PROBE(offsetof(FifoDeviceHandle, size));
  PROBE(offsetof(FifoDeviceHandle, rank));
  PROBE(offsetof(FifoDeviceHandle, id));
  PROBE(sizeof(PortChannelDeviceHandle));
  PROBE(offsetof(PortChannelDeviceHandle, semaphore));
  PROBE(offsetof(PortChannelDeviceHandle, channel));
  PROBE(offsetof(PortChannelDeviceHandle, dst_mem));
  PROBE(offsetof(PortChannelDeviceHandle, src_mem));
  PROBE(sizeof(MemoryChannelDeviceHandle));
  PROBE(offsetof(MemoryChannelDeviceHandle, dst));
  PROBE(offsetof(MemoryChannelDeviceHandle, src));
  PROBE(offsetof(MemoryChannelDeviceHandle, packets));
  PROBE(sizeof(LL8Packet));
  PROBE(sizeof(LL16Packet));
  // Trigger packing, checked against the Rust encoder.
  const ProxyTrigger t = make_data_trigger(kTriggerData | kTriggerSignal, 0xABC, 0x12, 0x89ABCDEF,
                                           0x34, 0x76543210, 0xFEDCBA98);
  PROBE(t.fst);
  PROBE(t.snd);
  const ProxyTrigger a = make_atomic_trigger(kTriggerAtomicAdd32, 7, 9, 0x1000, -5);
  PROBE(a.fst);
  PROBE(a.snd);
  out[n] = ~0ull;  // end marker
}
