package config

import (
	"reflect"
	"slices"
	"strings"
)

// Diff lists the key paths whose values differ between a and b
// (server.metrics.addr, backends.pivirtd.timeout, routing.rules), sorted.
// A list is one value: any change of it names the list.
func Diff(a, b *Config) []string {
	var out []string
	diff(reflect.ValueOf(a).Elem(), reflect.ValueOf(b).Elem(), "", &out)
	slices.Sort(out)
	return out
}

func diff(a, b reflect.Value, path string, out *[]string) {
	switch a.Kind() {
	case reflect.Struct:
		for _, f := range fieldsOf(a.Type()) {
			diff(a.Field(f.index), b.Field(f.index), joinKey(path, f.name), out)
		}
	case reflect.Map:
		keys := map[string]reflect.Value{}
		for _, k := range a.MapKeys() {
			keys[k.String()] = k
		}
		for _, k := range b.MapKeys() {
			keys[k.String()] = k
		}
		for name, k := range keys {
			av, bv := a.MapIndex(k), b.MapIndex(k)
			p := joinKey(path, name)
			switch {
			case !av.IsValid() || !bv.IsValid():
				*out = append(*out, p)
			case av.Kind() == reflect.Struct:
				diff(av, bv, p, out)
			case !reflect.DeepEqual(av.Interface(), bv.Interface()):
				*out = append(*out, p)
			}
		}
	default:
		if !reflect.DeepEqual(a.Interface(), b.Interface()) {
			*out = append(*out, path)
		}
	}
}

// Under reports whether key is prefix or below it.
func Under(key, prefix string) bool {
	return key == prefix || strings.HasPrefix(key, prefix+".") || strings.HasPrefix(key, prefix+"[")
}
