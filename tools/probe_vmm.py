"""Probe the driver's virtual memory API on this machine (for the vmm upstream's design).

Prints: the allocation granularity (minimum, recommended) with and without the POSIX file
descriptor handle type; whether reserve / create / map / set-access / export work; what
cuMemGetInfo counts for a mapped range; one memset across two separately created, adjacent
mappings; and the cost of mapping and unmapping 2 MiB and 20 MiB chunks, against cuMemAlloc /
cuMemFree of the same sizes. Run: ``python tools/probe_vmm.py``.
"""

import time

from cuda.bindings import driver as cu

MiB = 1 << 20


def ok(result, what):
    err, *rest = result
    if int(err):
        name = cu.cuGetErrorName(err)[1]
        raise RuntimeError(f"{what}: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def prop_for(device, handle_type):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = handle_type
    return prop


def access(device):
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def used():
    free, total = ok(cu.cuMemGetInfo(), "cuMemGetInfo")
    return int(total) - int(free)


def main():
    ok(cu.cuInit(0), "cuInit")
    dev = ok(cu.cuDeviceGet(0), "cuDeviceGet")
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev), "retain")
    ok(cu.cuCtxSetCurrent(ctx), "set current")
    H = cu.CUmemAllocationHandleType
    G = cu.CUmemAllocationGranularity_flags
    for name in ("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"):
        attr = getattr(cu.CUdevice_attribute, name, None)
        if attr is not None:
            print(f"{name}: {ok(cu.cuDeviceGetAttribute(attr, dev), name)}")
    props = {}
    for label, ht in (("none", H.CU_MEM_HANDLE_TYPE_NONE),
                      ("posix_fd", H.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)):
        prop = props[label] = prop_for(0, ht)
        for flag in (G.CU_MEM_ALLOC_GRANULARITY_MINIMUM, G.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED):
            try:
                g = ok(cu.cuMemGetAllocationGranularity(prop, flag), "granularity")
                print(f"granularity handle={label} {flag.name}: {g} B")
            except RuntimeError as exc:
                print(f"granularity handle={label} {flag.name}: {exc}")
    desc = access(0)
    span = 1 << 36
    va = ok(cu.cuMemAddressReserve(span, 0, 0, 0), "cuMemAddressReserve 64 GiB")
    base = int(va)
    print(f"reserved 64 GiB of address space at {base:#x}")
    for label, prop in props.items():
        before = used()
        try:
            h1 = ok(cu.cuMemCreate(2 * MiB, prop, 0), f"cuMemCreate 2 MiB ({label})")
            h2 = ok(cu.cuMemCreate(2 * MiB, prop, 0), f"cuMemCreate 2 MiB ({label})")
            ok(cu.cuMemMap(base, 2 * MiB, 0, h1, 0), "cuMemMap 1")
            ok(cu.cuMemMap(base + 2 * MiB, 2 * MiB, 0, h2, 0), "cuMemMap 2")
            ok(cu.cuMemSetAccess(base, 4 * MiB, [desc], 1), "cuMemSetAccess 4 MiB, 2 maps")
            ok(cu.cuMemsetD8(base, 7, 4 * MiB), "memset across two mappings")
            ok(cu.cuCtxSynchronize(), "sync")
            print(f"handle={label}: two 2 MiB pages mapped adjacently, one memset over both: ok;"
                  f" cuMemGetInfo used +{(used() - before) / MiB:.1f} MiB")
            if label == "posix_fd":
                try:
                    fd = ok(cu.cuMemExportToShareableHandle(h1, H.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                                            0), "export")
                    print(f"cuMemExportToShareableHandle(POSIX fd): ok, fd={fd}")
                except RuntimeError as exc:
                    print(f"cuMemExportToShareableHandle(POSIX fd): {exc}")
            ok(cu.cuMemUnmap(base, 4 * MiB), "unmap both in one call")
            ok(cu.cuMemRelease(h1), "release")
            print(f"handle={label}: after unmap, before release of 2nd: used "
                  f"+{(used() - before) / MiB:.1f} MiB")
            ok(cu.cuMemRelease(h2), "release")
            print(f"handle={label}: after release: used +{(used() - before) / MiB:.1f} MiB")
        except RuntimeError as exc:
            print(f"handle={label}: {exc}")
    for label, prop in props.items():
        for chunk in (2 * MiB, 20 * MiB):
            n, handles = 64, []
            try:
                t0 = time.perf_counter()
                for i in range(n):
                    h = ok(cu.cuMemCreate(chunk, prop, 0), "create")
                    ok(cu.cuMemMap(base + i * chunk, chunk, 0, h, 0), "map")
                    ok(cu.cuMemSetAccess(base + i * chunk, chunk, [desc], 1), "access")
                    handles.append(h)
                t1 = time.perf_counter()
                for i, h in enumerate(handles):
                    ok(cu.cuMemUnmap(base + i * chunk, chunk), "unmap")
                    ok(cu.cuMemRelease(h), "release")
                t2 = time.perf_counter()
                print(f"handle={label} {chunk // MiB} MiB: create+map+access "
                      f"{(t1 - t0) / n * 1e6:.1f} us, unmap+release {(t2 - t1) / n * 1e6:.1f} us")
            except RuntimeError as exc:
                print(f"handle={label} {chunk // MiB} MiB: {exc}")
        # Access set once over many pages mapped first.
        try:
            n, chunk, handles = 64, 2 * MiB, []
            t0 = time.perf_counter()
            for i in range(n):
                h = ok(cu.cuMemCreate(chunk, prop, 0), "create")
                ok(cu.cuMemMap(base + i * chunk, chunk, 0, h, 0), "map")
                handles.append(h)
            ok(cu.cuMemSetAccess(base, n * chunk, [desc], 1), "access")
            t1 = time.perf_counter()
            ok(cu.cuMemUnmap(base, n * chunk), "unmap")
            for h in handles:
                ok(cu.cuMemRelease(h), "release")
            t2 = time.perf_counter()
            print(f"handle={label} 64 x 2 MiB, one access call: {(t1 - t0) / n * 1e6:.1f} us "
                  f"per page, one unmap + releases {(t2 - t1) / n * 1e6:.1f} us per page")
        except RuntimeError as exc:
            print(f"handle={label} batched: {exc}")
    for chunk in (2 * MiB, 20 * MiB):
        n = 64
        t0 = time.perf_counter()
        ptrs = [ok(cu.cuMemAlloc(chunk), "cuMemAlloc") for _ in range(n)]
        t1 = time.perf_counter()
        for p in ptrs:
            ok(cu.cuMemFree(p), "cuMemFree")
        t2 = time.perf_counter()
        print(f"cuMemAlloc {chunk // MiB} MiB: {(t1 - t0) / n * 1e6:.1f} us, cuMemFree "
              f"{(t2 - t1) / n * 1e6:.1f} us")
    before = used()
    p = ok(cu.cuMemAlloc(1 * MiB + 256), "alloc")
    print(f"cuMemAlloc(1 MiB + 256 B): used +{(used() - before) / MiB:.2f} MiB")
    q = ok(cu.cuMemAlloc(3 * MiB), "alloc")
    print(f"+ cuMemAlloc(3 MiB): used +{(used() - before) / MiB:.2f} MiB")
    ok(cu.cuMemFree(p), "free")
    ok(cu.cuMemFree(q), "free")
    ok(cu.cuMemAddressFree(base, span), "cuMemAddressFree")
    print("probe done")


if __name__ == "__main__":
    main()
