// Umbrella header: the core API and every press.
#pragma once

#include "kvpress/cache.h"
#include "kvpress/calibration.h"
#include "kvpress/distributed.h"
#include "kvpress/io/atomic_file.h"
#include "kvpress/io/gguf.h"
#include "kvpress/io/safetensors.h"
#include "kvpress/kv_format.h"
#include "kvpress/lora.h"
#include "kvpress/model_view.h"
#include "kvpress/ops.h"
#include "kvpress/paged.h"
#include "kvpress/press_params.h"
#include "kvpress/presses.h"  // every press (generated from CMakeLists.txt's KVPRESS_PRESSES)
#include "kvpress/registry.h"
#include "kvpress/types.h"
#include "kvpress/version.h"
