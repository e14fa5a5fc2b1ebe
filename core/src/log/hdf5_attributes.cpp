// HDF5 attributes (C API), shared by the run log, the weights export and plugins.
#include <flashdraft/hdf5_attributes.hpp>

#include <hdf5.h>

#include <stdexcept>

namespace flashdraft::hdf5 {

namespace {

hid_t checked(hid_t id, const std::string& what) {
  if (id < 0) throw std::runtime_error("HDF5: " + what + " failed");
  return id;
}

// Closes HDF5 ids at scope exit, whatever throws in between.
struct Ids {
  std::vector<std::pair<hid_t, herr_t (*)(hid_t)>> ids;
  hid_t add(hid_t id, herr_t (*close)(hid_t)) {
    ids.emplace_back(id, close);
    return id;
  }
  ~Ids() {
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) it->second(it->first);
  }
};

void replace(hid_t object, const std::string& key) {
  if (H5Aexists(object, key.c_str()) > 0) H5Adelete(object, key.c_str());
}

}  // namespace

void write_string_attribute(int64_t object, const std::string& key, const std::string& value) {
  Ids ids;
  const hid_t type = ids.add(checked(H5Tcopy(H5T_C_S1), "string type for attribute " + key), H5Tclose);
  H5Tset_size(type, H5T_VARIABLE);
  H5Tset_cset(type, H5T_CSET_UTF8);
  const hid_t space = ids.add(checked(H5Screate(H5S_SCALAR), "dataspace of attribute " + key), H5Sclose);
  replace(object, key);
  const hid_t attr = ids.add(
      checked(H5Acreate2(object, key.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT), "creating attribute " + key),
      H5Aclose);
  const char* p = value.c_str();
  if (H5Awrite(attr, type, &p) < 0) throw std::runtime_error("HDF5: writing attribute " + key + " failed");
}

void write_int_attribute(int64_t object, const std::string& key, const std::vector<int64_t>& values) {
  Ids ids;
  const hsize_t n = values.size();
  const hid_t space = ids.add(checked(H5Screate_simple(1, &n, nullptr), "dataspace of attribute " + key), H5Sclose);
  replace(object, key);
  const hid_t attr = ids.add(checked(H5Acreate2(object, key.c_str(), H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT),
                                     "creating attribute " + key),
                             H5Aclose);
  if (H5Awrite(attr, H5T_NATIVE_INT64, values.data()) < 0)
    throw std::runtime_error("HDF5: writing attribute " + key + " failed");
}

std::vector<int64_t> read_int_attribute(int64_t object, const std::string& key) {
  Ids ids;
  const hid_t attr = ids.add(checked(H5Aopen(object, key.c_str(), H5P_DEFAULT), "opening attribute " + key), H5Aclose);
  const hid_t space = ids.add(checked(H5Aget_space(attr), "dataspace of attribute " + key), H5Sclose);
  std::vector<int64_t> v(static_cast<size_t>(H5Sget_simple_extent_npoints(space)));
  if (H5Aread(attr, H5T_NATIVE_INT64, v.data()) < 0)
    throw std::runtime_error("HDF5: reading attribute " + key + " failed");
  return v;
}

}  // namespace flashdraft::hdf5
