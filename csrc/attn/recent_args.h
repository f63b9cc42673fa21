// Host side of the recent rows (exl3_core/reference/kv_recent.py): their pointers and strides into a decode
// kernel's arguments.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "attn/attn_common.cuh"

inline void set_recent_args(exl3_attn::RecentArgs& a, const std::optional<at::Tensor>& k_ring, const std::optional<at::Tensor>& v_ring,
                     const std::optional<at::Tensor>& tags, const std::optional<at::Tensor>& slots, int64_t window) {
    if (k_ring.has_value()) {
        a.kr = reinterpret_cast<const uint32_t*>(k_ring->data_ptr());
        a.kr_n = k_ring->stride(0), a.kr_r = k_ring->stride(1);
    }
    if (v_ring.has_value()) {
        a.vr = reinterpret_cast<const uint32_t*>(v_ring->data_ptr());
        a.vr_n = v_ring->stride(0), a.vr_r = v_ring->stride(1);
    }
    a.tags = tags->data_ptr<int>();
    a.slots = slots->data_ptr<int>();
    a.tg_n = tags->stride(0);
    a.window = (int)window;
    a.size = (int)tags->size(1);
}
