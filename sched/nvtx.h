/* NVTX ranges around task execution, so Nsight Systems shows each lane's tasks as a category of
 * the "moeflow" domain beside the CUDA work. Real calls (NVTX3, header-only) in the CUDA build;
 * empty inline functions when MOEFLOW_CUDA is not defined, so callers never need an #ifdef. */
#ifndef MF_NVTX_H
#define MF_NVTX_H

#ifdef MOEFLOW_CUDA
/* Opens a range named task_name in category lane_index (named lane_name the first time that lane
 * is seen) on the calling thread. Cheap when no profiler is attached; never fails. */
void mf_nvtx_range_push(int lane_index, const char *lane_name, const char *task_name);
/* Closes the calling thread's innermost range. */
void mf_nvtx_range_pop(void);
#else
static inline void mf_nvtx_range_push(int lane_index, const char *lane_name, const char *task_name)
{
    (void)lane_index;
    (void)lane_name;
    (void)task_name;
}
static inline void mf_nvtx_range_pop(void) {}
#endif

#endif
