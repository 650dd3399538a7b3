// Umbrella header of kvpress::llama, the Llama-family runner with presses in the loop
// (docs/LLAMA_RUNNER.md). Link kvpress::llama.
#pragma once

#include "kvpress/llama/chat.h"
#include "kvpress/llama/checkpoint.h"
#include "kvpress/llama/config.h"
#include "kvpress/llama/eval.h"
#include "kvpress/llama/generation.h"
#include "kvpress/llama/gguf.h"
#include "kvpress/llama/kvcompose.h"
#include "kvpress/llama/model.h"
#include "kvpress/llama/pipeline.h"
#include "kvpress/llama/stories.h"
#include "kvpress/llama/tokenizer.h"
