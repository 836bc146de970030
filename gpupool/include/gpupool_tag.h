/* The calling thread's current tag (gpupool.tag; core/tagged.pxd): its id, 0 for none.
 *
 * A static thread-local: every extension module that includes this header has its own copy.
 * The one that counts is core/pool.pyx's module, where core/tagging.pxi sets it and the
 * pool's requests (acquire.pxd, fastpath.pxd, inlined there) read it; no other module reads
 * or sets it.
 */
#ifndef GPUPOOL_TAG_H
#define GPUPOOL_TAG_H

static __thread int gp_current_tag __attribute__((unused)) = 0;

/* Make tag the calling thread's current tag; returns the one before. */
static inline int gp_tag_swap(int tag) {
    int prev = gp_current_tag;
    gp_current_tag = tag;
    return prev;
}

#endif /* GPUPOOL_TAG_H */
