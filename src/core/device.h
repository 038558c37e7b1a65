/* The device registry: what the library knows of each device other than the CPU, behind one
 * interface (memory, its kernels in the public registry, the layers' ops tables). The core
 * names no device's functions; a device is one table and one line in device.c. */
#ifndef BIE_DEVICE_H
#define BIE_DEVICE_H

#include "bie.h"

struct bie_layer_ops;

typedef struct bie_device_iface {
    bie_device_type type;
    const char *name;
    void (*free_ptr)(void *p); /* memory of bie_tensor_free; ignores NULL */
    /* Its kernels in the public kernel registry. */
    int (*kernel_count)(void);
    void (*kernel_describe)(int index, bie_kernel_info *info);
    int (*kernel_index)(int id); /* -1: not one of its kernels */
    /* The layers' operations of a kind on this device (NULL: the kind does not run here). */
    const struct bie_layer_ops *(*layer_ops)(bie_layer_kind kind);
} bie_device_iface;

/* The interface of a device type this build has, or NULL (the CPU has none: it is the
 * library itself). */
const bie_device_iface *bie_device_get(bie_device_type type);
/* Number of registered devices, and the i-th (for the kernel registry's enumeration). */
int bie_device_count(void);
const bie_device_iface *bie_device_at(int i);

#endif
