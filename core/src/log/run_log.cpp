// HDF5 run log (C API): chunked extendable datasets, SWMR writer, flushed per step.
#include "log/run_log.hpp"

#include <flashdraft/hdf5_attributes.hpp>

#include <hdf5.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace flashdraft {

namespace {

void check(herr_t status, const std::string& what) {
  if (status < 0) throw std::runtime_error("HDF5 run log: " + what + " failed");
}
hid_t check_id(hid_t id, const std::string& what) {
  if (id < 0) throw std::runtime_error("HDF5 run log: " + what + " failed");
  return id;
}

hid_t string_type(int64_t len) {
  hid_t t = H5Tcopy(H5T_C_S1);
  H5Tset_size(t, static_cast<size_t>(len));
  H5Tset_strpad(t, H5T_STR_NULLTERM);
  H5Tset_cset(t, H5T_CSET_UTF8);
  return t;
}

}  // namespace

struct RunLog::Dataset {
  hid_t id = -1;
  hid_t mem_type = -1;
  Type type = Type::f64;
  int64_t width = 0;  // 0: 1-D
  int64_t str_len = 0;
  int64_t rows = 0;
  ~Dataset() {
    if (mem_type >= 0 && type == Type::str) H5Tclose(mem_type);
    if (id >= 0) H5Dclose(id);
  }
};

RunLog::RunLog(const std::string& path, const std::map<std::string, std::string>& attributes) : path_(path) {
  hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
  // SWMR needs the latest file format (HDF5 >= 1.10; h5py reads it).
  H5Pset_libver_bounds(fapl, H5F_LIBVER_LATEST, H5F_LIBVER_LATEST);
  file_ = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
  H5Pclose(fapl);
  if (file_ < 0) throw std::runtime_error("cannot create the run log " + path + " (is the folder writable?)");
  for (const auto& [k, v] : attributes) hdf5::write_string_attribute(file_, k, v);
}

std::unique_ptr<RunLog> RunLog::reopen(const std::string& path) {
  std::unique_ptr<RunLog> log(new RunLog());
  log->path_ = path;
  hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
  H5Pset_libver_bounds(fapl, H5F_LIBVER_LATEST, H5F_LIBVER_LATEST);
  // A writer killed in SWMR mode (SIGKILL, OOM killer) leaves the superblock's "open for
  // writing" flags set and HDF5 refuses to open the file for writing again; h5clear's
  // file-access property clears them. The log itself is consistent at every flushed step.
  hbool_t clear_flags = 1;
  H5E_BEGIN_TRY { H5Pset(fapl, "clear_status_flags", &clear_flags); }
  H5E_END_TRY;
  log->file_ = H5Fopen(path.c_str(), H5F_ACC_RDWR, fapl);
  H5Pclose(fapl);
  if (log->file_ < 0) throw std::runtime_error("cannot open the run log " + path + " to append to it");
  // Discover datasets two levels deep (group/name).
  LogReader probe_names(path);  // read-only view to list members
  for (const auto& g : probe_names.members("/")) {
    for (const auto& m : probe_names.members("/" + g)) {
      const std::string name = g + "/" + m;
      auto ds = std::make_unique<Dataset>();
      ds->id = H5Dopen2(log->file_, name.c_str(), H5P_DEFAULT);
      if (ds->id < 0) continue;
      hid_t ftype = H5Dget_type(ds->id);
      hid_t space = H5Dget_space(ds->id);
      hsize_t dims[2] = {0, 0};
      const int rank = H5Sget_simple_extent_dims(space, dims, nullptr);
      ds->rows = static_cast<int64_t>(dims[0]);
      ds->width = rank == 2 ? static_cast<int64_t>(dims[1]) : 0;
      if (H5Tget_class(ftype) == H5T_STRING) {
        ds->type = Type::str;
        ds->str_len = static_cast<int64_t>(H5Tget_size(ftype));
        ds->mem_type = string_type(ds->str_len);
      } else if (H5Tget_class(ftype) == H5T_FLOAT) {
        ds->type = Type::f64;
        ds->mem_type = H5T_NATIVE_DOUBLE;
      } else if (H5Tget_size(ftype) == 8) {
        ds->type = Type::i64;
        ds->mem_type = H5T_NATIVE_INT64;
      } else {
        ds->type = Type::i32;
        ds->mem_type = H5T_NATIVE_INT32;
      }
      H5Sclose(space);
      H5Tclose(ftype);
      log->datasets_[name] = std::move(ds);
    }
  }
  return log;
}

RunLog::~RunLog() {
  datasets_.clear();
  for (auto& [name, id] : groups_) H5Gclose(id);
  if (file_ >= 0) H5Fclose(file_);
}

int64_t RunLog::group(const std::string& name) {
  auto it = groups_.find(name);
  if (it != groups_.end()) return it->second;
  hid_t g = H5Lexists(file_, name.c_str(), H5P_DEFAULT) > 0
                ? H5Gopen2(file_, name.c_str(), H5P_DEFAULT)
                : H5Gcreate2(file_, name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  groups_[name] = check_id(g, "group " + name);
  return g;
}

void RunLog::declare(const std::string& name, Type type, int64_t width, int64_t str_len, const std::string& doc) {
  if (started_) throw std::logic_error("RunLog: dataset " + name + " declared after start()");
  if (datasets_.count(name)) return;  // reopened logs already have it
  const auto slash = name.find('/');
  if (slash != std::string::npos) group(name.substr(0, slash));
  auto ds = std::make_unique<Dataset>();
  ds->type = type;
  ds->width = width;
  ds->str_len = str_len;
  const int rank = width > 0 ? 2 : 1;
  hsize_t dims[2] = {0, static_cast<hsize_t>(width)};
  hsize_t maxdims[2] = {H5S_UNLIMITED, static_cast<hsize_t>(width)};
  hsize_t chunk[2] = {width > 0 ? 64u : 256u, static_cast<hsize_t>(std::max<int64_t>(width, 1))};
  hid_t space = H5Screate_simple(rank, dims, maxdims);
  hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
  H5Pset_chunk(dcpl, rank, chunk);
  hid_t ftype = -1;
  switch (type) {
    case Type::f64:
      ftype = H5Tcopy(H5T_IEEE_F64LE);
      ds->mem_type = H5T_NATIVE_DOUBLE;
      break;
    case Type::i64:
      ftype = H5Tcopy(H5T_STD_I64LE);
      ds->mem_type = H5T_NATIVE_INT64;
      break;
    case Type::i32:
      ftype = H5Tcopy(H5T_STD_I32LE);
      ds->mem_type = H5T_NATIVE_INT32;
      break;
    case Type::str:
      ftype = string_type(str_len);
      ds->mem_type = string_type(str_len);
      break;
  }
  ds->id = check_id(H5Dcreate2(file_, name.c_str(), ftype, space, H5P_DEFAULT, dcpl, H5P_DEFAULT), "dataset " + name);
  if (!doc.empty()) hdf5::write_string_attribute(ds->id, "doc", doc);
  H5Tclose(ftype);
  H5Pclose(dcpl);
  H5Sclose(space);
  datasets_[name] = std::move(ds);
}

void RunLog::set_group_attribute(const std::string& g, const std::string& key, const std::string& value) {
  if (started_) throw std::logic_error("RunLog: attribute " + key + " set after start()");
  hdf5::write_string_attribute(g == "/" ? file_ : group(g), key, value);
}

void RunLog::start() {
  check(H5Fstart_swmr_write(file_), "starting SWMR write on " + path_);
  started_ = true;
}

RunLog::Dataset& RunLog::get(const std::string& name, Type type) {
  auto it = datasets_.find(name);
  if (it == datasets_.end()) throw std::logic_error("RunLog: dataset " + name + " was not declared");
  if (it->second->type != type) throw std::logic_error("RunLog: dataset " + name + " appended with another type");
  return *it->second;
}

namespace {
void append_row(hid_t id, hid_t mem_type, int64_t& rows, int64_t width, const void* data, int64_t count) {
  const int rank = width > 0 ? 2 : 1;
  const hsize_t w = static_cast<hsize_t>(std::max<int64_t>(width, 1));
  if (width > 0 && count != width)
    throw std::logic_error("RunLog: row of " + std::to_string(count) + " values, dataset width " +
                           std::to_string(width));
  hsize_t new_dims[2] = {static_cast<hsize_t>(rows + 1), w};
  check(H5Dset_extent(id, new_dims), "extending a dataset");
  hid_t fspace = H5Dget_space(id);
  hsize_t start[2] = {static_cast<hsize_t>(rows), 0};
  hsize_t count_[2] = {1, w};
  H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start, nullptr, count_, nullptr);
  hid_t mspace = H5Screate_simple(rank, count_, nullptr);
  check(H5Dwrite(id, mem_type, mspace, fspace, H5P_DEFAULT, data), "writing a row");
  H5Sclose(mspace);
  H5Sclose(fspace);
  ++rows;
}
}  // namespace

void RunLog::append(const std::string& name, const std::vector<double>& row) {
  Dataset& d = get(name, Type::f64);
  append_row(d.id, d.mem_type, d.rows, d.width, row.data(), static_cast<int64_t>(row.size()));
}
void RunLog::append(const std::string& name, const std::vector<int64_t>& row) {
  Dataset& d = get(name, Type::i64);
  append_row(d.id, d.mem_type, d.rows, d.width, row.data(), static_cast<int64_t>(row.size()));
}
void RunLog::append(const std::string& name, const std::vector<int32_t>& row) {
  Dataset& d = get(name, Type::i32);
  append_row(d.id, d.mem_type, d.rows, d.width, row.data(), static_cast<int64_t>(row.size()));
}
void RunLog::append(const std::string& name, const std::string& text) {
  Dataset& d = get(name, Type::str);
  std::vector<char> buf(static_cast<size_t>(d.str_len), '\0');
  std::memcpy(buf.data(), text.data(), std::min<size_t>(text.size(), buf.size() - 1));
  append_row(d.id, d.mem_type, d.rows, 0, buf.data(), 1);
}

void RunLog::truncate(const std::string& name, int64_t rows) {
  auto it = datasets_.find(name);
  if (it == datasets_.end() || it->second->rows <= rows) return;
  hsize_t dims[2] = {static_cast<hsize_t>(rows), static_cast<hsize_t>(std::max<int64_t>(it->second->width, 1))};
  check(H5Dset_extent(it->second->id, dims), "truncating " + name);
  it->second->rows = rows;
}

int64_t RunLog::rows(const std::string& name) const {
  auto it = datasets_.find(name);
  return it == datasets_.end() ? 0 : it->second->rows;
}
bool RunLog::has(const std::string& name) const { return datasets_.count(name) > 0; }
int64_t RunLog::width(const std::string& name) const {
  const auto it = datasets_.find(name);
  return it == datasets_.end() ? -1 : it->second->width;
}
std::vector<std::string> RunLog::names() const {
  std::vector<std::string> out;
  for (const auto& [name, ds] : datasets_) out.push_back(name);
  return out;
}

void RunLog::flush() { check(H5Fflush(file_, H5F_SCOPE_GLOBAL), "flushing " + path_); }

// ---------------------------------------------------------------------------
LogReader::LogReader(const std::string& path) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
  file_ = H5Fopen(path.c_str(), H5F_ACC_RDONLY | H5F_ACC_SWMR_READ, fapl);
  if (file_ < 0) file_ = H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl);
  H5Pclose(fapl);
  if (file_ < 0) throw std::runtime_error(path + ": cannot open as an HDF5 run log (missing, or not an HDF5 file)");
}
LogReader::~LogReader() {
  if (file_ >= 0) H5Fclose(file_);
}

std::map<std::string, std::string> LogReader::attributes(const std::string& object) const {
  std::map<std::string, std::string> out;
  hid_t obj = H5Oopen(file_, object.c_str(), H5P_DEFAULT);
  if (obj < 0) return out;
  H5O_info_t info;
  H5Oget_info2(obj, &info, H5O_INFO_NUM_ATTRS);
  for (hsize_t i = 0; i < info.num_attrs; ++i) {
    hid_t a = H5Aopen_by_idx(obj, ".", H5_INDEX_NAME, H5_ITER_INC, i, H5P_DEFAULT, H5P_DEFAULT);
    char name[256] = {0};
    H5Aget_name(a, sizeof(name), name);
    hid_t t = H5Aget_type(a);
    if (H5Tget_class(t) == H5T_STRING) {
      if (H5Tis_variable_str(t) > 0) {
        char* p = nullptr;
        hid_t mt = H5Tcopy(H5T_C_S1);
        H5Tset_size(mt, H5T_VARIABLE);
        H5Tset_cset(mt, H5Tget_cset(t));
        if (H5Aread(a, mt, &p) >= 0 && p) {
          out[name] = p;
          H5free_memory(p);
        }
        H5Tclose(mt);
      } else {
        std::string s(H5Tget_size(t), '\0');
        H5Aread(a, t, s.data());
        out[name] = s.c_str();
      }
    }
    H5Tclose(t);
    H5Aclose(a);
  }
  H5Oclose(obj);
  return out;
}

bool LogReader::exists(const std::string& name) const {
  // Check each path component (H5Lexists needs the parents to exist).
  size_t pos = 0;
  while ((pos = name.find('/', pos + 1)) != std::string::npos)
    if (H5Lexists(file_, name.substr(0, pos).c_str(), H5P_DEFAULT) <= 0) return false;
  return H5Lexists(file_, name.c_str(), H5P_DEFAULT) > 0;
}

std::vector<int64_t> LogReader::shape(const std::string& name) const {
  hid_t d = H5Dopen2(file_, name.c_str(), H5P_DEFAULT);
  if (d < 0) return {};
  H5Drefresh(d);
  hid_t s = H5Dget_space(d);
  hsize_t dims[8];
  const int rank = H5Sget_simple_extent_dims(s, dims, nullptr);
  std::vector<int64_t> out(dims, dims + std::max(rank, 0));
  H5Sclose(s);
  H5Dclose(d);
  return out;
}

std::vector<double> LogReader::f64(const std::string& name) const {
  hid_t d = H5Dopen2(file_, name.c_str(), H5P_DEFAULT);
  if (d < 0) throw std::runtime_error("run log has no dataset " + name);
  H5Drefresh(d);
  hid_t s = H5Dget_space(d);
  const hssize_t n = H5Sget_simple_extent_npoints(s);
  std::vector<double> out(static_cast<size_t>(n));
  if (n > 0) H5Dread(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data());
  H5Sclose(s);
  H5Dclose(d);
  return out;
}

std::vector<std::string> LogReader::strings(const std::string& name) const {
  hid_t d = H5Dopen2(file_, name.c_str(), H5P_DEFAULT);
  if (d < 0) throw std::runtime_error("run log has no dataset " + name);
  H5Drefresh(d);
  hid_t t = H5Dget_type(d);
  const size_t len = H5Tget_size(t);
  hid_t s = H5Dget_space(d);
  const hssize_t n = H5Sget_simple_extent_npoints(s);
  std::vector<char> buf(static_cast<size_t>(n) * len + 1, '\0');
  if (n > 0) H5Dread(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data());
  std::vector<std::string> out;
  for (hssize_t i = 0; i < n; ++i) out.emplace_back(std::string(buf.data() + i * len, len).c_str());
  H5Sclose(s);
  H5Tclose(t);
  H5Dclose(d);
  return out;
}

std::vector<std::string> LogReader::members(const std::string& group) const {
  std::vector<std::string> out;
  hid_t g = H5Gopen2(file_, group.c_str(), H5P_DEFAULT);
  if (g < 0) return out;
  H5G_info_t info;
  H5Gget_info(g, &info);
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    char name[256] = {0};
    H5Lget_name_by_idx(g, ".", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof(name), H5P_DEFAULT);
    out.emplace_back(name);
  }
  H5Gclose(g);
  return out;
}

}  // namespace flashdraft
