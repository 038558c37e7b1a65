/* The device registry (device.h). */
#include "device.h"

#ifdef BIE_HAVE_CUDA
extern const bie_device_iface bie_cuda_device;
#endif

static const bie_device_iface *const devices[] = {
#ifdef BIE_HAVE_CUDA
    &bie_cuda_device,
#endif
    NULL,
};

int bie_device_count(void) { return (int)(sizeof devices / sizeof devices[0]) - 1; }

const bie_device_iface *bie_device_at(int i) {
    return i >= 0 && i < bie_device_count() ? devices[i] : NULL;
}

const bie_device_iface *bie_device_get(bie_device_type type) {
    for (int i = 0; i < bie_device_count(); i++)
        if (devices[i]->type == type) return devices[i];
    return NULL;
}
