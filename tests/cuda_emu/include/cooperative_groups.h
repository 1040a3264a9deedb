// CPU emulation (see cuda_runtime.h): the thread-block cluster group. The CTAs of a cluster
// run on OS threads of their own; sync() is a barrier over all their GPU threads, and
// map_shared_rank finds the same shared variable in another CTA's storage.
#pragma once

#include "cuda_runtime.h"

namespace cuda_emu {
unsigned cluster_num_blocks();
unsigned cluster_block_rank();
void cluster_sync();
void* map_shared_rank(void* address, unsigned rank);
}  // namespace cuda_emu

namespace cooperative_groups {

class cluster_group {
 public:
  unsigned num_blocks() const { return cuda_emu::cluster_num_blocks(); }
  unsigned block_rank() const { return cuda_emu::cluster_block_rank(); }
  void sync() const { cuda_emu::cluster_sync(); }
  template <typename T>
  T* map_shared_rank(T* address, unsigned rank) const {
    return static_cast<T*>(cuda_emu::map_shared_rank(const_cast<void*>(static_cast<const void*>(address)), rank));
  }
};

inline cluster_group this_cluster() { return {}; }

}  // namespace cooperative_groups
