/* NVTX3 ranges for the executor (see nvtx.h): one "moeflow" domain created once, one category per
 * lane named on first use. Compiles to nothing without MOEFLOW_CUDA (the header's inline stubs). */
#ifdef MOEFLOW_CUDA

#include "sched/nvtx.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include <nvtx3/nvToolsExt.h>

#define MF_NVTX_NAMED_LANES 64

static pthread_once_t mf_nvtx_once = PTHREAD_ONCE_INIT;
static nvtxDomainHandle_t mf_nvtx_domain;
static _Atomic uint64_t mf_nvtx_named;   /* bit i: category i+1 has been named */

static void mf_nvtx_init(void)
{
    mf_nvtx_domain = nvtxDomainCreateA("moeflow");
}

void mf_nvtx_range_push(int lane_index, const char *lane_name, const char *task_name)
{
    pthread_once(&mf_nvtx_once, mf_nvtx_init);
    /* Category 0 means "none" to NVTX, so lane i is category i + 1. */
    uint32_t category = lane_index >= 0 ? (uint32_t)lane_index + 1 : 0;
    if (lane_index >= 0 && lane_index < MF_NVTX_NAMED_LANES && lane_name) {
        uint64_t bit = (uint64_t)1 << lane_index;
        if (!(atomic_load_explicit(&mf_nvtx_named, memory_order_relaxed) & bit) &&
            !(atomic_fetch_or(&mf_nvtx_named, bit) & bit))
            nvtxDomainNameCategoryA(mf_nvtx_domain, category, lane_name);
    }
    nvtxEventAttributes_t a = {0};
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.category = category;
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = task_name ? task_name : "task";
    nvtxDomainRangePushEx(mf_nvtx_domain, &a);
}

void mf_nvtx_range_pop(void)
{
    pthread_once(&mf_nvtx_once, mf_nvtx_init);
    nvtxDomainRangePop(mf_nvtx_domain);
}

#else
/* ISO C forbids an empty translation unit. */
typedef int mf_nvtx_unused;
#endif
