/* The calling thread's stack of entered regions (and uncached() markers), innermost last:
 * part of the thread's state (gp_thread.h); core/regionstack.pxi pushes and pops it, core/thread.pxd
 * reads it on every allocation. */
#ifndef GPUPOOL_REGION_STACK_H
#define GPUPOOL_REGION_STACK_H

#define GP_REGION_DEPTH_MAX 64

struct gp_region_stack {
    int depth;
    void* entries[GP_REGION_DEPTH_MAX];
};

#endif
