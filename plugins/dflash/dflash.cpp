// The "dflash" drafter plugin: the DFlash drafter of dflash_drafter.hpp, as configured by
// [drafter] plugin = "dflash".
#include "dflash_drafter.hpp"

#include <flashdraft/plugin.hpp>

FLASHDRAFT_PLUGIN(drafter, "dflash", "0.1.0", "DFlash block-diffusion drafter: Qwen3 layers with target KV injection",
                  flashdraft::dflash::DFlashDrafter)
