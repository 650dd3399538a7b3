// Umbrella header: the core API and every press.
#pragma once

#include "kvpress/io/safetensors.h"
#include "kvpress/ops.h"
#include "kvpress/presses/base_press.h"
#include "kvpress/presses/keydiff_press.h"
#include "kvpress/presses/knorm_press.h"
#include "kvpress/presses/lagkv_press.h"
#include "kvpress/presses/observed_attention_press.h"
#include "kvpress/presses/random_press.h"
#include "kvpress/presses/snapkv_press.h"
#include "kvpress/presses/streaming_llm_press.h"
#include "kvpress/presses/tova_press.h"
#include "kvpress/registry.h"
#include "kvpress/types.h"
#include "kvpress/version.h"
