import { defineConfig } from 'vite'
import vue from '@vitejs/plugin-vue'

// base './': the built site works under any URL prefix (the broker serves
// it at /preview/<id>/).
export default defineConfig({
  plugins: [vue()],
  base: './',
})
